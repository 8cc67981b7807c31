"""The node's scratch space kept from running out (shim/host/diskreserve.py): a pod's disk
is checked against the free space less what the running pods' disks may still take less
the reserve, read from the pods' sandbox.json and their QEMUs' descriptors; a pod whose
processes are gone claims nothing."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

from shim.config import HypervisorConfig
from shim.host import diskreserve
from shim.host.podstate import STATE_FILE
from shim.host.processes import start_time
from shim.host.shimstate import SHIM_STATE
from shim.resources import NoFit

from .test_podstate import state

MIB = 1 << 20
HOLDER = """
import os, sys, time
fd = os.open(sys.argv[1], os.O_TMPFILE | os.O_RDWR, 0o600)
os.ftruncate(fd, 512 << 20)
os.pwrite(fd, b"x" * (8 << 20), 0)
os.fsync(fd)
print(os.fstat(fd).st_ino, flush=True)
time.sleep(60)
"""


@pytest.fixture
def qemu(tmp_path):
    """A process holding an unnamed 512 MiB file with 8 MiB written, as QEMU holds a disk
    (and pytest's capture, an unnamed file too, as its stderr): its pid and the inode."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        yield proc.pid, int(proc.stdout.readline())
    finally:
        proc.kill()
        proc.wait()


def write_pod(root, name: str, disk_mib: int, **changes) -> None:
    directory = root / "k8s.io" / name
    directory.mkdir(parents=True)
    value = state(sandbox_id=name, **changes)
    value = dataclasses.replace(value, plan=dataclasses.replace(value.plan, disk_mib=disk_mib))
    value.save(str(directory / STATE_FILE))


def config(tmp_path, reserve_mib: int = 1024) -> HypervisorConfig:
    return HypervisorConfig(scratch_path=str(tmp_path), scratch_reserve_mib=reserve_mib)


def test_a_running_pods_disk_claims_its_size_less_what_it_holds(tmp_path, qemu) -> None:
    root = tmp_path / "state"
    pid, inode = qemu
    write_pod(root, "running", 512, qemu_pid=pid, qemu_start_time=start_time(pid),
              scratch_inode=inode)
    device = os.stat(tmp_path).st_dev
    disk = diskreserve.scratch_file(pid, inode, device)
    assert disk is not None and disk.st_size == 512 * MIB and disk.st_blocks * 512 == 8 * MIB
    assert diskreserve.scratch_file(pid, inode + 1, device) is None
    (claim,) = diskreserve.claims(device, str(root))
    assert (claim.sandbox_id, claim.may_still_take) == ("running", 504 * MIB)
    q = config(tmp_path)
    # free 2000 MiB, less 504 claimed, less 1024 reserved: 472 MiB of room
    diskreserve.check(q, "new", 472, str(root), free=2000 * MIB)
    with pytest.raises(NoFit) as refused:
        diskreserve.check(q, "new", 473, str(root), free=2000 * MIB)
    message = str(refused.value)
    assert "scratch disk of 473 MiB" in message and "room for 472 MiB" in message
    assert "504 MiB the disks of 1 other pods" in message and "scratch_reserve_mib" in message
    # the pod's own state is not a claim against itself
    diskreserve.check(q, "running", 976, str(root), free=2000 * MIB)
    # a disk on another file system (another scratch_path) takes nothing from this one
    assert diskreserve.claims(device + 1, str(root)) == []


def test_pods_whose_processes_are_gone_claim_nothing(tmp_path) -> None:
    root = tmp_path / "state"
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    pid = int(gone.stdout)
    write_pod(root, "crashed", 4096, qemu_pid=pid, qemu_start_time=12345)
    write_pod(root, "stopped", 4096, qemu_pid=0, boot_seconds=2.0)
    write_pod(root, "booting-dead-shim", 4096, qemu_pid=0)
    (root / "k8s.io" / "booting-dead-shim" / SHIM_STATE).write_text(f'{{"pid": {pid}}}')
    write_pod(root, "no-disk", 0, qemu_pid=os.getpid(), qemu_start_time=start_time(os.getpid()))
    (root / "k8s.io" / "not-a-pod").mkdir()
    assert diskreserve.claims(os.stat(tmp_path).st_dev, str(root)) == []
    diskreserve.check(config(tmp_path, 0), "new", 1000, str(root), free=1000 * MIB)


def test_a_booting_pod_claims_its_whole_disk_while_its_shim_lives(tmp_path) -> None:
    root = tmp_path / "state"
    write_pod(root, "booting", 300, qemu_pid=0)
    (root / "k8s.io" / "booting" / SHIM_STATE).write_text(f'{{"pid": {os.getpid()}}}')
    (claim,) = diskreserve.claims(os.stat(tmp_path).st_dev, str(root))
    assert claim.may_still_take == 300 * MIB
    with pytest.raises(NoFit, match="disk"):
        diskreserve.check(config(tmp_path, 0), "new", 701, str(root), free=1000 * MIB)


def test_checks_are_one_at_a_time_and_none_without_a_disk(tmp_path) -> None:
    q = config(tmp_path / "scratch")
    with diskreserve.reserving(q, "none", 0, str(tmp_path / "state")):
        assert not (tmp_path / "scratch").exists()  # no disk: nothing checked or made
    import fcntl
    with diskreserve.reserving(q, "a", 1, str(tmp_path / "state")):
        lock = os.open(tmp_path / "state" / diskreserve.LOCK, os.O_RDWR)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(lock)
    with pytest.raises(NoFit, match="scratch disk of"):
        with diskreserve.reserving(q, "huge", 1 << 40, str(tmp_path / "state")):
            pass
    assert not (tmp_path / "scratch").exists()  # the disk's directory is the disk's to make
