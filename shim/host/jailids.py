"""The uid and gid each VM's QEMU runs as: one of its own, node-wide, as Firecracker's
jailer gives each microVM (shim/vm/qemu/jail.py uses it). Two QEMUs, or a QEMU and any
process of the node (containerd, kubelet, a shim, virtiofsd: uid 0), then never share a
uid, so the kernel's own checks refuse what a QEMU taken over by its guest would try
on them: signals (kill, and SIGIO through F_SETOWN/F_SETSIG), ptrace, prlimit64,
process_vm_readv and perf_event_open on them, their keyrings, their files.

The ids are a range of the configuration ([hypervisor.qemu] jail_id_first and
jail_id_count: the same number as uid and gid), handed out through a directory of
claims in /run (CLAIMS): a claim is a file named for the id, made with O_EXCL, holding
its owner (the VM's work directory). So two shims, or a shim restarted, never hand out
one id twice, and the claims live as long as the pods they name: through a shim's or
containerd's restart, not through a reboot (which ends every VM). A claim is dropped
when its VM stops (QemuVM.stop), by `shim delete`'s cleanup of a pod whose shim died
(release_under), and taken back when the range is full and its owner's work directory
is gone with no process left running as that id (a claim a crashed shim left)."""
from __future__ import annotations

import errno
import os
import zlib

import psutil

CLAIMS = "/run/podvm/jail-ids"


class JailIdsExhausted(OSError):
    """Every id of the range is claimed by a VM that still exists."""


def claim(owner: str, first: int, count: int, claims: str = CLAIMS) -> int:
    """An id of [first, first + count) claimed for `owner`: tried from a point that
    depends on the owner (few collisions between shims claiming at once), then, when all
    are taken, again after stale claims were dropped."""
    directory = _open_claims(claims)
    try:
        start = zlib.crc32(owner.encode()) % count
        for sweep in (False, True):
            if sweep:
                _drop_stale(directory, first, count)
            for step in range(count):
                number = first + (start + step) % count
                if _try_claim(directory, number, owner):
                    return number
    finally:
        os.close(directory)
    raise JailIdsExhausted(errno.EUSERS,
                           f"all {count} ids of QEMU's jail ({first}-{first + count - 1}, "
                           f"[hypervisor.qemu] jail_id_first and jail_id_count) are taken by "
                           f"running VMs: raise jail_id_count")


def release(number: int, owner: str, claims: str = CLAIMS) -> None:
    """Drop `owner`'s claim of `number`; a claim of another owner (the id handed out
    again after this one was taken back as stale) is left alone."""
    try:
        directory = _open_claims(claims, create=False)
    except FileNotFoundError:
        return
    try:
        if _owner(directory, str(number)) == owner:
            _unlink(directory, str(number))
    finally:
        os.close(directory)


def release_under(prefix: str, claims: str = CLAIMS) -> list[int]:
    """Drop every claim whose owner is `prefix` or below it (a pod's state directory,
    after its shim died): the ids dropped."""
    try:
        directory = _open_claims(claims, create=False)
    except FileNotFoundError:
        return []
    dropped = []
    try:
        for name in os.listdir(directory):
            owner = _owner(directory, name)
            if owner is not None and (owner == prefix or owner.startswith(prefix + "/")):
                _unlink(directory, name)
                dropped.append(int(name))
    finally:
        os.close(directory)
    return sorted(dropped)


def owner_of(number: int, claims: str = CLAIMS) -> str | None:
    try:
        directory = _open_claims(claims, create=False)
    except FileNotFoundError:
        return None
    try:
        return _owner(directory, str(number))
    finally:
        os.close(directory)


def _open_claims(claims: str, create: bool = True) -> int:
    if create:
        os.makedirs(claims, mode=0o700, exist_ok=True)
    return os.open(claims, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)


def _try_claim(directory: int, number: int, owner: str) -> bool:
    try:
        fd = os.open(str(number), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW |
                     os.O_CLOEXEC, 0o600, dir_fd=directory)
    except FileExistsError:
        return False
    try:
        os.write(fd, owner.encode())
    finally:
        os.close(fd)
    return True


def _owner(directory: int, name: str) -> str | None:
    if not name.isdigit():
        return None
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     dir_fd=directory)
    except FileNotFoundError:
        return None
    try:
        return os.read(fd, 4096).decode(errors="replace")
    finally:
        os.close(fd)


def _unlink(directory: int, name: str) -> None:
    try:
        os.unlink(name, dir_fd=directory)
    except FileNotFoundError:
        pass


def _drop_stale(directory: int, first: int, count: int) -> None:
    """Claims in the range whose owner's directory is gone and whose id runs nothing."""
    running = _running_uids()
    for name in os.listdir(directory):
        if not name.isdigit() or not first <= int(name) < first + count:
            continue
        owner = _owner(directory, name)
        if owner is not None and not os.path.lexists(owner) and int(name) not in running:
            _unlink(directory, name)


def _running_uids() -> set[int]:
    """Every real, effective and saved uid of every process."""
    uids: set[int] = set()
    for proc in psutil.process_iter(["uids"]):
        uids.update(proc.info["uids"] or ())
    return uids
