"""The pod's scratch disk, the file on the host behind it: where its containers' writable layers live, as an
ext4 file system the guest mounts (guest/agent/writable.py), so that creating, changing
and removing files never leaves the guest.

Each disk is an unnamed file (O_TMPFILE) in `scratch_path`, sparse: a copy of the blank
file system (`blank`, by mke2fs, BLANK_MIB; grown to the pod's size after boot), handed
to QEMU as a descriptor (shim/vm/qemu/driver.py). No path leads to it, so it is gone with the
last descriptor, when QEMU exits, however the pod ends: nothing to sweep after a crash,
and no other process can open it by name. QEMU writes it with O_DIRECT (the host's page
cache holds none of it: the guest's page cache, in the pod's RAM, is its cache), and the
guest's discards punch holes in it, so the host disk it takes is what the pod's layers
hold now, at most the disk's size."""
from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import subprocess

from ..config import HypervisorConfig
from ..resources.storage import BLANK_MIB
from .memcopy import extents

LABEL = "podvm-scratch"
# No journal (the disk dies with the pod: there is nothing to recover after a crash);
# the inode tables left to be zeroed lazily, which the guest never does (it mounts
# with noinit_itable: unused inodes are marked so in the group descriptors).
# -T default: 4 KiB blocks and an inode per 16 KiB, as for the size it is grown to (mke2fs
# would make the small blank a "small" file system: 1 KiB blocks, an inode per 4 KiB).
# Project quotas (their usage kept in a hidden inode, no quota file): the guest bounds
# each container's layer and each emptyDir by its own number (guest/agent/quota.py).
_MKE2FS_ARGS = ("-q", "-F", "-t", "ext4", "-T", "default", "-O",
                "^has_journal,quota,project", "-m", "0", "-L", LABEL,
                "-E", "lazy_itable_init=1,lazy_journal_init=1,nodiscard,root_owner=0:0,"
                "quotatype=prjquota")


class ScratchError(OSError):
    """The scratch disk could not be made: the message says where and why."""


def blank_name() -> str:
    """The blank's file name: its size, and its mke2fs arguments' digest, so that a blank
    made otherwise (by an older podvm) is never taken for it."""
    made_as = hashlib.sha256(" ".join(_MKE2FS_ARGS).encode()).hexdigest()[:8]
    return f"blank-{BLANK_MIB}M-{made_as}.ext4"


def blank(q: HypervisorConfig) -> str:
    """The path of the blank file system every scratch disk starts as (BLANK_MIB, one
    size for all pods: each disk is grown to its pod's size once the guest is up,
    shim/vm/scratchgrow.py), made now by `q`'s mke2fs if it is not there (under a lock:
    one maker at a time, the others wait for it and use it). Its identity is part of a
    template's key (a template's guest has read its first blocks)."""
    directory, size_mib = q.scratch_path, BLANK_MIB
    path = os.path.join(directory, blank_name())
    if os.path.exists(path):
        return path
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        lock = os.open(os.path.join(directory, ".lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC,
                       0o600)
    except OSError as exc:
        raise ScratchError(exc.errno, f"scratch_path {directory}: {exc.strerror}") from None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(path):
            _make(path, size_mib, q.scratch_mke2fs)
    finally:
        os.close(lock)
    return path


def _make(path: str, size_mib: int, mke2fs: str) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.truncate(size_mib << 20)
        try:
            done = subprocess.run([mke2fs, *_MKE2FS_ARGS, tmp], capture_output=True,
                                  text=True, timeout=60)
        except FileNotFoundError:
            raise ScratchError(errno.ENOENT, f"scratch_mke2fs {mke2fs} not found: the "
                               f"scratch disk needs e2fsprogs (or scratch_disk_mib = 0)") \
                from None
        if done.returncode != 0:
            raise ScratchError(errno.EIO, f"{mke2fs} {tmp} failed: "
                                          f"{(done.stderr or done.stdout).strip()}")
        os.rename(tmp, path)
    except OSError as exc:
        if isinstance(exc, ScratchError):
            raise
        raise ScratchError(exc.errno, f"blank scratch file system {path}: "
                                      f"{exc.strerror}") from None
    finally:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass


def open_for(q: HypervisorConfig) -> int:
    """The descriptor of a new scratch disk as `q` configures it; -1 for none."""
    return open_disk(blank(q)) if q.scratch_disk_mib else -1


def open_disk(blank_path: str) -> int:
    """A new scratch disk: an unnamed file beside `blank_path` with its content (its
    holes kept), read-write; the caller closes the descriptor once QEMU has it."""
    directory = os.path.dirname(blank_path)
    try:
        fd = os.open(directory, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise ScratchError(exc.errno, f"scratch disk in {directory}: {exc.strerror}"
                           + (" (its file system cannot hold unnamed files)"
                              if exc.errno == errno.EOPNOTSUPP else "")) from None
    try:
        source = os.open(blank_path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            size = os.fstat(source).st_size
            _copy_data(source, fd)
        finally:
            os.close(source)
        os.ftruncate(fd, size)
    except OSError as exc:
        os.close(fd)
        raise ScratchError(exc.errno, f"scratch disk from {blank_path}: {exc.strerror}") \
            from None
    return fd


def _copy_data(source: int, target: int) -> None:
    """Only the extents that hold data (a few MiB of the blank's metadata); the holes
    stay holes."""
    for start, length in extents(source):
        position, end = start, start + length
        while position < end:
            copied = os.copy_file_range(source, target, end - position, position, position)
            if copied == 0:
                raise OSError(errno.EIO, "short copy")
            position += copied
