"""Paths resolved beneath a directory descriptor, never through a symlink, and mounts
attached, changed and detached through descriptors: the few system calls that keep the
shim inside a directory someone else can write (the pod's shared directory, whose
containers' roots and volumes the guest writes through the share).

libpathrs (PyPI `pathrs`) does this job, but its Python package is a binding that needs
the Rust library installed, which neither Debian 12 nor PyPI ships: these are the calls
podvm needs, each one a system call with the flags that refuse a symlink or a mount
crossing. Linux 5.12 or later (mount_setattr)."""
from __future__ import annotations

import ctypes
import errno
import os
import stat

from ..libc import last_errno, libc

_SYS_OPEN_TREE = 428  # the same number on every architecture (added since 5.1)
_SYS_MOVE_MOUNT = 429
_SYS_OPENAT2 = 437
_SYS_MOUNT_SETATTR = 442

RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
STRICT = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS
"""Below the directory, no symlink anywhere on the way, mounts may be crossed."""
SKELETON = STRICT | RESOLVE_NO_XDEV
"""As STRICT, and no mount crossed: what the shim made itself, never a container's tree."""

AT_FDCWD = -100
AT_EMPTY_PATH = 0x1000
AT_RECURSIVE = 0x8000
OPEN_TREE_CLONE = 0x1
MOVE_MOUNT_F_EMPTY_PATH = 0x4
MOVE_MOUNT_T_EMPTY_PATH = 0x40
MOUNT_ATTR_RDONLY = 0x1
MOUNT_ATTR_NOSUID = 0x2
MOUNT_ATTR_NODEV = 0x4
MOUNT_ATTR_NOEXEC = 0x8
MS_PRIVATE = 1 << 18
MS_SHARED = 1 << 20
MNT_DETACH = 0x2
UMOUNT_NOFOLLOW = 0x8


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64),
                ("resolve", ctypes.c_uint64)]


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def _check(result: int, what: str) -> int:
    if result < 0:
        err = last_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


def openat2(dirfd: int, path: str, flags: int, resolve: int = STRICT, mode: int = 0) -> int:
    """A descriptor of `path` below `dirfd`; ELOOP for a symlink on the way, EXDEV for a
    mount crossed under RESOLVE_NO_XDEV, EXDEV for `..` out of `dirfd`."""
    how = _OpenHow(flags | os.O_CLOEXEC, mode, resolve)
    return _check(libc().syscall(_SYS_OPENAT2, dirfd, os.fsencode(path), ctypes.byref(how),
                                 ctypes.sizeof(how)), f"open {path} beneath its directory")


def open_dir(dirfd: int, path: str, resolve: int = SKELETON) -> int:
    """An O_PATH descriptor of the directory `path` below `dirfd`."""
    return openat2(dirfd, path, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW, resolve)


def make_dir(dirfd: int, name: str, mode: int = 0o755) -> int:
    """The directory `name` directly in `dirfd`, made if missing: its O_PATH descriptor
    (never one a symlink put there leads to)."""
    _one_name(name)
    try:
        os.mkdir(name, mode, dir_fd=dirfd)
    except FileExistsError:
        pass
    return open_dir(dirfd, name)


def make_file(dirfd: int, name: str, mode: int = 0o644) -> int:
    """The empty file `name` directly in `dirfd` (a mount target), made if missing: its
    O_PATH descriptor. A symlink, directory or special file there is refused."""
    _one_name(name)
    fd = openat2(dirfd, name, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK,
                 SKELETON, mode)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, f"{name} is not a regular file")
        return openat2(dirfd, name, os.O_PATH | os.O_NOFOLLOW, SKELETON)
    finally:
        os.close(fd)


def _one_name(name: str) -> None:
    if not name or "/" in name or name in (".", ".."):
        raise ValueError(f"{name!r} is not one path component")


def clone_tree(path: str, recursive: bool = True, dirfd: int = AT_FDCWD) -> int:
    """A detached copy of the mount at `path` (its submounts too when `recursive`), as
    a descriptor to attach with `attach`."""
    flags = OPEN_TREE_CLONE | os.O_CLOEXEC | (AT_RECURSIVE if recursive else 0) | \
        (AT_EMPTY_PATH if not path else 0)
    return _check(libc().syscall(_SYS_OPEN_TREE, dirfd, os.fsencode(path), flags),
                  f"open_tree {path or dirfd}")


def set_attributes(fd: int, attr_set: int = 0, attr_clr: int = 0, propagation: int = 0,
                   recursive: bool = False) -> None:
    """mount_setattr on the mount `fd` is (a detached tree's too)."""
    attr = _MountAttr(attr_set, attr_clr, propagation, 0)
    flags = AT_EMPTY_PATH | (AT_RECURSIVE if recursive else 0)
    _check(libc().syscall(_SYS_MOUNT_SETATTR, fd, b"", flags, ctypes.byref(attr),
                          ctypes.sizeof(attr)), "mount_setattr")


def attach(tree: int, target: int) -> None:
    """Attach the detached mount `tree` on the file or directory the descriptor `target`
    is (no path is looked up again, so nothing can be swapped in between)."""
    _check(libc().syscall(_SYS_MOVE_MOUNT, tree, b"", target, b"",
                          MOVE_MOUNT_F_EMPTY_PATH | MOVE_MOUNT_T_EMPTY_PATH), "move_mount")


def detach(fd: int) -> bool:
    """Detach the mount whose root `fd` is (lazily, with all below it); False when `fd`
    is no mount's root. Through the descriptor's /proc link: no path is looked up."""
    if libc().umount2(f"/proc/self/fd/{fd}".encode(), MNT_DETACH) != 0:
        err = last_errno()
        if err == errno.EINVAL:
            return False
        raise OSError(err, f"umount: {os.strerror(err)}")
    return True


def detach_all(dirfd: int, name: str) -> int:
    """Detach every mount stacked on `name` in `dirfd`; how many."""
    count = 0
    for _ in range(64):  # bounded: each round takes the top mount of the stack
        try:
            fd = openat2(dirfd, name, os.O_PATH | os.O_NOFOLLOW, STRICT)
        except FileNotFoundError:
            break
        try:
            if not detach(fd):
                break
        finally:
            os.close(fd)
        count += 1
    return count


def remove_all(dirfd: int, name: str) -> None:
    """Remove `name` in `dirfd` and all below it without following a symlink or going
    into a mount (EBUSY names what is still mounted: nothing in it is touched)."""
    try:
        st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=dirfd)
        return
    try:
        fd = openat2(dirfd, name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, SKELETON)
    except OSError as exc:
        if exc.errno == errno.EXDEV:
            raise OSError(errno.EBUSY, f"{name} is still mounted: not removed") from None
        raise
    try:
        for entry in os.listdir(fd):
            remove_all(fd, entry)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=dirfd)
