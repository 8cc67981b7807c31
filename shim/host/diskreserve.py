"""The node's scratch space kept from running out (issue 44): before a pod's VM boots, its
scratch disk must fit in the free space of `scratch_path`'s file system, less what the
disks of the pods already there may still take, less `scratch_reserve_mib`.

Every shim reads the same facts: each pod's sandbox.json (shim/host/podstate.py) under the
state root, whose plan holds its disk's size and which records the disk's inode, and the
disk itself through its QEMU's descriptors (/proc/<pid>/fd: the disk is an unnamed file,
so its allocated blocks are what it holds on the host). A pod counts while its QEMU lives (its recorded pid and start
time), or, before its first boot, while its shim lives; a crashed shim's or a stopped
pod's claim ends with its processes, with nothing to sweep. Checks are one at a time
(a lock beside the pods' state) from the check until the pod's claim is in its sandbox.json."""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import stat
from dataclasses import dataclass
from typing import Iterator

from ..config import HypervisorConfig
from ..resources import NoFit
from . import paths
from .podstate import STATE_FILE, PodState, PodStateError
from .processes import start_time
from .shimstate import SHIM_STATE

MIB = 1 << 20
LOCK = ".reserve.lock"


@dataclass(frozen=True)
class Claim:
    sandbox_id: str
    size_bytes: int
    held_bytes: int
    """What the disk takes on the host now (0 before its QEMU has it)."""

    @property
    def may_still_take(self) -> int:
        return max(0, self.size_bytes - self.held_bytes)


def scratch_file(pid: int, inode: int, device: int | None,
                 proc: str = "/proc") -> os.stat_result | None:
    """The stat of QEMU `pid`'s scratch disk, the unnamed file `inode` on file system
    `device` (None: any) it holds (st_size its size, st_blocks what it takes); None when
    it has none."""
    fd_dir = os.path.join(proc, str(pid), "fd")
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return None
    for name in names:
        try:
            st = os.stat(os.path.join(fd_dir, name))
        except OSError:
            continue
        # (named once, in the pod's log directory, where kubelet counts it: podlogdisk.py)
        if st.st_ino == inode and device in (None, st.st_dev) and stat.S_ISREG(st.st_mode):
            return st
    return None


def of_pod(state: PodState, device: int | None, proc: str = "/proc") -> os.stat_result | None:
    """The pod's scratch disk as its recorded QEMU holds it; None before it is recorded."""
    if not state.scratch_inode or not state.qemu_pid:
        return None
    return scratch_file(state.qemu_pid, state.scratch_inode, device, proc)


def claims(device: int, root: str = paths.STATE_ROOT, proc: str = "/proc",
           exclude: str = "") -> list[Claim]:
    """The scratch disks of the pods under `root` whose processes live (not `exclude`)."""
    found = []
    for state_dir in _state_dirs(root):
        if os.path.basename(state_dir) == exclude:
            continue
        try:
            state = PodState.load(os.path.join(state_dir, STATE_FILE))
        except (OSError, PodStateError):
            continue  # not a pod, or one going away
        if not state.plan.disk_mib:
            continue
        size = state.plan.disk_mib * MIB
        if state.qemu_pid and start_time(state.qemu_pid) == state.qemu_start_time:
            disk = of_pod(state, None, proc)
            if disk is not None and disk.st_dev != device:
                continue  # its disk is on another file system (another scratch_path)
            found.append(Claim(state.sandbox_id, size,
                               disk.st_blocks * 512 if disk is not None else 0))
        elif not state.qemu_pid and not state.boot_seconds and _shim_lives(state_dir):
            found.append(Claim(state.sandbox_id, size, 0))  # booting
    return found


def _state_dirs(root: str) -> Iterator[str]:
    try:
        namespaces = os.listdir(root)
    except FileNotFoundError:
        return
    for namespace in namespaces:
        try:
            groups = os.listdir(os.path.join(root, namespace))
        except OSError:
            continue
        for group in groups:
            yield os.path.join(root, namespace, group)


def _shim_lives(state_dir: str) -> bool:
    try:
        with open(os.path.join(state_dir, SHIM_STATE), "rb") as f:
            pid = json.load(f).get("pid")
    except (OSError, ValueError, AttributeError):
        return False
    return isinstance(pid, int) and start_time(pid) is not None


def check(q: HypervisorConfig, sandbox_id: str, disk_mib: int, root: str = paths.STATE_ROOT,
          proc: str = "/proc", free: int | None = None) -> None:
    """NoFit, naming the disk and the numbers, when `disk_mib` does not fit. `free`:
    the bytes free on scratch_path's file system (default: statvfs's, unprivileged)."""
    where = _existing(q.scratch_path)  # made with the first disk (shim/vm/scratchdisk.py)
    if free is None:
        fs = os.statvfs(where)
        free = fs.f_bavail * fs.f_frsize
    device = os.stat(where).st_dev
    others = claims(device, root, proc, exclude=sandbox_id)
    claimed = sum(c.may_still_take for c in others)
    reserve = q.scratch_reserve_mib * MIB
    room = free - claimed - reserve
    if disk_mib * MIB > room:
        raise NoFit(f"the pod needs a scratch disk of {disk_mib} MiB but {q.scratch_path} "
                    f"has room for {max(0, room) // MIB} MiB: {free // MIB} MiB free, less "
                    f"{claimed // MIB} MiB the disks of {len(others)} other pods may still "
                    f"take, less the {q.scratch_reserve_mib} MiB reserve "
                    f"(scratch_reserve_mib)")


def _existing(path: str) -> str:
    """`path`, or the nearest directory above it that exists: the file system it will
    be made on."""
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


@contextlib.contextmanager
def reserving(q: HypervisorConfig, sandbox_id: str, disk_mib: int,
              root: str = paths.STATE_ROOT) -> Iterator[None]:
    """check(), then the caller records its claim (its sandbox.json with the plan) before
    the next shim's check: one at a time, under a lock beside the pods' state (in /run:
    nothing of it outlives a reboot, and nothing is made in `scratch_path` before the
    disk is)."""
    if not disk_mib:
        yield
        return
    os.makedirs(root, mode=0o711, exist_ok=True)
    lock = os.open(os.path.join(root, LOCK),
                   os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        check(q, sandbox_id, disk_mib, root)
        yield
    finally:
        os.close(lock)
