"""The scratch disk's name in the pod's log directory: what kubelet counts of it, and a
name that is removed only while it is still the disk's."""
from __future__ import annotations

import os
import subprocess

import pytest

from shim.host import podlogdisk


def _unnamed(directory, data_mib: int) -> int:
    fd = os.open(directory, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
    os.ftruncate(fd, 64 << 20)  # sparse, as a scratch disk is
    os.pwrite(fd, os.urandom(1 << 20) * data_mib, 8 << 20)
    os.fsync(fd)
    return fd


def _du_bytes(path) -> int:
    """What kubelet's du-based measure reads: the blocks the files hold."""
    out = subprocess.run(["du", "-s", "-B1", str(path)], capture_output=True, text=True,
                         check=True).stdout
    return int(out.split()[0])


def test_kubelet_counts_what_the_disk_holds_not_its_size(tmp_path):
    logs = tmp_path / "ns_pod_uid"
    logs.mkdir()
    fd = _unnamed(tmp_path, 3)
    try:
        before = _du_bytes(logs)
        shown = podlogdisk.show(f"/proc/self/fd/{fd}", str(logs), "a" * 64)
        assert shown is not None
        file = logs / shown.name
        assert file.is_file() and not file.is_symlink()
        grown = _du_bytes(logs) - before
        assert 3 << 20 <= grown < 4 << 20  # the data, not the disk's 64 MiB
        os.pwrite(fd, b"x" * (2 << 20), 32 << 20)  # the guest writes: seen at once
        os.fsync(fd)
        assert _du_bytes(logs) - before >= 5 << 20
        podlogdisk.hide(shown)
        assert not file.exists()
        assert os.fstat(fd).st_nlink == 0  # unnamed again, gone with its last descriptor
    finally:
        os.close(fd)


def test_a_stale_name_of_the_same_sandbox_is_replaced(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / podlogdisk.name_for("b" * 64)).write_bytes(b"old")
    fd = _unnamed(tmp_path, 1)
    try:
        shown = podlogdisk.show(f"/proc/self/fd/{fd}", str(logs), "b" * 64)
        assert shown is not None
        assert os.stat(logs / shown.name).st_ino == os.fstat(fd).st_ino
    finally:
        os.close(fd)


def test_hide_leaves_a_file_that_is_no_longer_the_disk(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    fd = _unnamed(tmp_path, 1)
    try:
        shown = podlogdisk.show(f"/proc/self/fd/{fd}", str(logs), "c" * 64)
        os.unlink(logs / shown.name)
        (logs / shown.name).write_bytes(b"someone else's")
        podlogdisk.hide(shown)
        assert (logs / shown.name).read_bytes() == b"someone else's"
        podlogdisk.hide(podlogdisk.Shown(str(tmp_path / "gone"), "x", 0, 0))  # no error
    finally:
        os.close(fd)


@pytest.mark.parametrize("kind", ["symlink", "relative", "missing"])
def test_a_directory_that_is_not_a_real_one_gets_no_name(tmp_path, kind, caplog):
    target = tmp_path / "real"
    target.mkdir()
    if kind == "symlink":
        directory = tmp_path / "link"
        directory.symlink_to(target)
    elif kind == "relative":
        directory = "real"
    else:
        directory = tmp_path / "missing"
    fd = _unnamed(tmp_path, 1)
    try:
        assert podlogdisk.show(f"/proc/self/fd/{fd}", str(directory), "d" * 64) is None
        assert list(target.iterdir()) == []
        assert "not shown in pod log directory" in caplog.text
    finally:
        os.close(fd)


def test_another_file_system_is_said_not_failed(tmp_path, caplog):
    """/dev/shm is a tmpfs: no link reaches it from tmp_path's file system."""
    if os.stat("/dev/shm").st_dev == os.stat(tmp_path).st_dev:
        pytest.fail("the test needs /dev/shm on another file system than tmp_path")
    import tempfile
    with tempfile.TemporaryDirectory(dir="/dev/shm") as other:
        fd = _unnamed(tmp_path, 1)
        try:
            assert podlogdisk.show(f"/proc/self/fd/{fd}", other, "e" * 64) is None
            assert "another file system" in caplog.text
            assert os.listdir(other) == []
        finally:
            os.close(fd)
