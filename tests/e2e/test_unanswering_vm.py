"""A pod whose VM stops answering, and a pod whose disk fails, through containerd's CRI
(Debian's 1.6), on real QEMU under TCG (docs/design.md, "A VM that stops answering").

- A VM that answers nothing (its QEMU stopped with SIGSTOP: neither QMP nor the guest's
  agent answers, as in a hung VMM; a QMP `stop` cannot come from the test, since QEMU's
  QMP socket serves one client and the shim is it: the FakeVM plays that one,
  tests/vm/test_unanswering_vm.py) is removed by `crictl stopp` and `rmp` within
  REMOVAL_BOUND, with nothing of it left, while another pod keeps answering.
- The host file system under two pods' scratch disks filled: the pod that writes meets an
  I/O error in its guest instead of a paused VM, and the other pod answers and writes."""
from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import time

import pytest

from testbed.containerd import cgroup_dirs
from testbed.cri import Crictl
from testbed.pods import pod_qemus, podvm_leftovers

from .test_crictl import wait_for
from .test_podvm_pods import configs, cri_containerd, remove_pod, runp, start_container  # noqa: F401

REMOVAL_BOUND = 90.0
"""Seconds `stopp` and `rmp` of a pod whose VM answers nothing may take in all: the kill's
deadline (shim/vm/agent.py RUNC, 30 s), then the VM killed and the pod removed as after
any VM death; well within kubelet's 2 minutes a call."""


def leftovers(ctd, pod_id: str) -> list[str]:
    return podvm_leftovers(ctd, pod_id) + [
        f"cgroup {d}" for d in cgroup_dirs(f"{ctd.cgroup_parent.strip('/')}/{pod_id}")]


@pytest.fixture(scope="module")
def ctd(tmp_path_factory, image_cache):
    yield from cri_containerd(tmp_path_factory, image_cache, "podvm-unanswering",
                              "podvm-unanswering-test")


@pytest.fixture(scope="module")
def crictl(ctd) -> Crictl:
    return Crictl(ctd.cri_endpoint, timeout="120s")  # kubelet's runtime-request-timeout


def test_a_pod_whose_vm_answers_nothing_is_removed_within_the_bound(ctd, crictl,
                                                                     configs) -> None:
    other, other_file = runp(crictl, ctd, configs, "still-answers")
    hung, hung_file = runp(crictl, ctd, configs, "hung")
    try:
        alive = start_container(crictl, configs, other, other_file, "alive", "sleep 1000")
        start_container(crictl, configs, hung, hung_file, "frozen", "sleep 1000")
        [qemu] = pod_qemus(hung)
        os.kill(qemu, signal.SIGSTOP)
        started = time.monotonic()
        stopped = crictl.run("stopp", hung, check=False)
        removed = crictl.run("rmp", hung, check=False)
        took = time.monotonic() - started
        assert stopped.returncode == 0, stopped.stderr
        assert removed.returncode == 0, removed.stderr
        assert took < REMOVAL_BOUND, took
        assert hung not in crictl.pods()
        wait_for("the hung pod's shim to exit", lambda: leftovers(ctd, hung) == [],
                 timeout=30)
        answered = crictl.exec(alive, "echo", "still here")
        assert (answered.exit_code, answered.stdout.strip()) == (0, "still here")
    finally:
        for pid in pod_qemus(hung):
            os.kill(pid, signal.SIGKILL)  # a failed run must not leave it stopped
        remove_pod(crictl, hung)
        remove_pod(crictl, other)
    assert leftovers(ctd, other) == []


DISK_FS_MIB = 300
SCRATCH_MIB = 64
ROOM_MIB = 16
"""What the test leaves free on the pods' host file system once it fills it."""


@pytest.fixture(scope="module")
def small_fs(tmp_path_factory):
    """An ext4 of DISK_FS_MIB on a loop device (no blocks reserved for root: QEMU writes as
    a uid of its own), unmounted afterwards."""
    where = tmp_path_factory.mktemp("small-fs")
    image, mountpoint = where / "fs.img", where / "mnt"
    mountpoint.mkdir()
    with open(image, "wb") as f:
        f.truncate(DISK_FS_MIB << 20)
    subprocess.run(["mkfs.ext4", "-q", "-m", "0", str(image)], check=True)
    subprocess.run(["mount", "-o", "loop", str(image), str(mountpoint)], check=True)
    try:
        yield mountpoint
    finally:
        subprocess.run(["umount", str(mountpoint)], check=True)
    assert not os.path.ismount(mountpoint)


@pytest.fixture(scope="module")
def disk_ctd(tmp_path_factory, image_cache, small_fs):
    yield from cri_containerd(tmp_path_factory, image_cache, "podvm-disk-full",
                              "podvm-disk-full-test", enable_template=False,
                              scratch_path=str(small_fs / "scratch"),
                              scratch_disk_mib=SCRATCH_MIB, scratch_reserve_mib=0)


def used(fs: pathlib.Path) -> int:
    st = os.statvfs(fs)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def fill(fs: pathlib.Path, leave_mib: int) -> pathlib.Path:
    """A file that takes all of `fs`'s free space but `leave_mib`."""
    st = os.statvfs(fs)
    filler = fs / "filler"
    size = st.f_bavail * st.f_frsize - (leave_mib << 20)
    subprocess.run(["fallocate", "-l", str(size), str(filler)], check=True)
    return filler


def test_a_full_host_disk_is_an_io_error_of_the_pod_that_writes(disk_ctd, configs,
                                                                 small_fs) -> None:
    ctd, crictl = disk_ctd, Crictl(disk_ctd.cri_endpoint, timeout="120s")
    before = used(small_fs)
    writer, writer_file = runp(crictl, ctd, configs, "disk-writer")
    other, other_file = runp(crictl, ctd, configs, "disk-other")
    filler = None
    try:
        w = start_container(crictl, configs, writer, writer_file, "w", "sleep 1000")
        o = start_container(crictl, configs, other, other_file, "o", "sleep 1000")
        made = crictl.exec(o, "sh", "-c", "dd if=/dev/zero of=/small bs=64k count=4 "
                                          "conv=fsync 2>&1")
        assert made.exit_code == 0, made.stdout + made.stderr
        filler = fill(small_fs, ROOM_MIB)
        # More than the host has left, less than the guest's own disk: the host says no.
        wrote = crictl.exec(w, "sh", "-c", f"dd if=/dev/zero of=/big bs=1M "
                                           f"count={ROOM_MIB * 3} conv=fsync 2>&1",
                            timeout=120)
        # EIO: the host's ENOSPC as virtio-blk tells it (the guest's own disk has room)
        assert wrote.exit_code != 0 and "Input/output error" in wrote.stdout, wrote.stdout
        # Both VMs still run: each answers, and the other one writes (over blocks its
        # disk has on the host: there is no more) and syncs.
        again = crictl.exec(w, "echo", "writer answers", timeout=60)
        assert (again.exit_code, again.stdout.strip()) == (0, "writer answers")
        rewrote = crictl.exec(o, "sh", "-c", "dd if=/dev/urandom of=/small bs=64k count=4 "
                                             "conv=notrunc,fsync 2>&1 && sync && echo synced",
                              timeout=60)
        assert rewrote.exit_code == 0 and "synced" in rewrote.stdout, rewrote.stdout
    finally:
        if filler is not None:
            filler.unlink()
        remove_pod(crictl, writer)
        remove_pod(crictl, other)
    for pod_id in (writer, other):
        wait_for(f"pod {pod_id} to leave nothing", lambda: leftovers(ctd, pod_id) == [],
                 timeout=60)
    # No disk holds the host's blocks any more: what is used is the named files (the blank)
    named = sum(p.stat().st_blocks * 512 for p in (small_fs / "scratch").rglob("*")
                if p.is_file())
    assert used(small_fs) - before <= named + (1 << 20), (used(small_fs), before, named)
