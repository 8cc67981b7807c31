"""The pod's scratch disk on the host (shim/vm/scratchdisk.py): a blank ext4 made once
per size, and per pod an unnamed copy of it that no path leads to, holding nothing of
another pod's disk, with its holes kept."""
from __future__ import annotations

import hashlib
import os
import pathlib
import re
import stat
import subprocess
import threading

import pytest

from shim.config import HypervisorConfig
from shim.resources.storage import BLANK_MIB
from shim.vm import scratchdisk
from testbed.prereqs import require_tool

MIB = 64


def config(directory: pathlib.Path, mke2fs: str = HypervisorConfig.scratch_mke2fs
           ) -> HypervisorConfig:
    return HypervisorConfig(scratch_path=str(directory), scratch_disk_mib=MIB,
                            scratch_mke2fs=mke2fs)


def _digest(fd: int, size: int) -> str:
    h = hashlib.sha256()
    for offset in range(0, size, 1 << 20):
        h.update(os.pread(fd, 1 << 20, offset))
    return h.hexdigest()


@pytest.fixture
def blank(tmp_path: pathlib.Path) -> str:
    require_tool("mke2fs", "e2fsprogs")
    return scratchdisk.blank(config(tmp_path / "scratch"))


def test_the_blank_is_an_ext4_of_the_size_made_once(blank: str) -> None:
    st = os.stat(blank)
    # one size for every pod, whatever scratch_disk_mib says (each disk grows after boot)
    assert st.st_size == BLANK_MIB << 20 and st.st_blocks * 512 < 8 << 20  # sparse
    said = subprocess.run(["dumpe2fs", "-h", blank], capture_output=True, text=True)
    assert said.returncode == 0, said.stderr
    assert "podvm-scratch" in said.stdout and "has_journal" not in said.stdout
    # 4 KiB blocks and room to grow online (reserved GDT blocks) to what pods ask
    assert re.search(r"Block size:\s+4096", said.stdout), said.stdout
    assert re.search(r"Reserved GDT blocks:\s+[1-9]", said.stdout), said.stdout
    again = scratchdisk.blank(config(pathlib.Path(blank).parent))
    assert again == blank and os.stat(again).st_mtime_ns == st.st_mtime_ns
    assert sorted(os.listdir(os.path.dirname(blank))) == [".lock", os.path.basename(blank)]


def test_makers_at_once_make_one_blank(tmp_path: pathlib.Path) -> None:
    require_tool("mke2fs", "e2fsprogs")
    directory, got, failed = tmp_path / "s", [], []

    def make() -> None:
        try:
            got.append(os.stat(scratchdisk.blank(config(directory))).st_ino)
        except Exception as exc:  # noqa: BLE001 - the test says which
            failed.append(exc)

    threads = [threading.Thread(target=make) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failed == [] and len(set(got)) == 1
    assert not [n for n in os.listdir(directory) if n.endswith(".tmp")]


def test_a_disk_is_an_unnamed_copy_that_keeps_nothing_of_another(blank: str) -> None:
    size = os.stat(blank).st_size
    with open(blank, "rb") as f:
        want = _digest(f.fileno(), size)
    first = scratchdisk.open_disk(blank)
    try:
        assert _digest(first, size) == want
        assert os.fstat(first).st_nlink == 0  # no path leads to it
        assert os.fstat(first).st_blocks * 512 < 8 << 20  # its holes kept
        assert "(deleted)" in os.readlink(f"/proc/self/fd/{first}")
        os.pwrite(first, b"secret of the first pod" * 100, size - (1 << 20))
        second = scratchdisk.open_disk(blank)
        try:
            assert _digest(second, size) == want  # the blank, not the first pod's disk
        finally:
            os.close(second)
    finally:
        os.close(first)
    assert sorted(os.listdir(os.path.dirname(blank))) == [".lock", os.path.basename(blank)]
    with open(blank, "rb") as f:
        assert _digest(f.fileno(), size) == want  # the blank is never written


def test_open_for_follows_the_configuration(tmp_path: pathlib.Path) -> None:
    require_tool("mke2fs", "e2fsprogs")
    assert scratchdisk.open_for(HypervisorConfig(scratch_disk_mib=0,
                                                 scratch_path=str(tmp_path))) == -1
    assert os.listdir(tmp_path) == []
    fd = scratchdisk.open_for(HypervisorConfig(scratch_disk_mib=MIB,
                                               scratch_path=str(tmp_path)))
    try:
        # the blank's size: the guest grows it to the pod's (shim/vm/scratchgrow.py)
        assert stat.S_ISREG(os.fstat(fd).st_mode) and os.fstat(fd).st_size == BLANK_MIB << 20
    finally:
        os.close(fd)


def test_errors_say_where_and_why(tmp_path: pathlib.Path) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("")
    with pytest.raises(scratchdisk.ScratchError, match=f"scratch_path {a_file}/s"):
        scratchdisk.blank(config(a_file / "s"))
    with pytest.raises(scratchdisk.ScratchError, match="scratch_mke2fs /no/mke2fs not found"):
        scratchdisk.blank(config(tmp_path / "s", "/no/mke2fs"))
    assert os.listdir(tmp_path / "s") == [".lock"]  # no half-made blank
    with pytest.raises(scratchdisk.ScratchError, match="failed"):
        scratchdisk.blank(config(tmp_path / "s", "false"))
    assert os.listdir(tmp_path / "s") == [".lock"]
    with pytest.raises(scratchdisk.ScratchError, match="scratch disk"):
        scratchdisk.open_disk(str(tmp_path / "missing" / "blank-64M.ext4"))
