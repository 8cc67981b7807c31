"""The C library's calls Python's os module lacks, for the agent: mount(2), umount2(2),
reboot(2), inotify(7), quotactl_fd(2). One handle, loaded with the agent (resume.py
needs it on the restore path, where an import costs 0.1 s under TCG), errors raised as
OSError."""
from __future__ import annotations

import ctypes
import os

_LIBC = ctypes.CDLL(None, use_errno=True)

MS_NOATIME = 0x400
MNT_DETACH = 0x2
LINUX_REBOOT_CMD_POWER_OFF = 0x4321FEDC


def _check(result: int, what: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


def mount(source: str, target: str, fstype: str, flags: int = 0, data: str = "") -> None:
    _check(_LIBC.mount(source.encode(), target.encode(), fstype.encode(), flags,
                       data.encode()), f"mount {fstype} {source} on {target}")


def umount(target: str, flags: int = MNT_DETACH) -> None:
    _check(_LIBC.umount2(target.encode(), flags), f"umount {target}")


def power_off() -> None:
    _LIBC.reboot(LINUX_REBOOT_CMD_POWER_OFF)


def inotify_init(flags: int) -> int:
    return _check(_LIBC.inotify_init1(flags), "inotify_init1")


def inotify_add_watch(fd: int, path: str, mask: int) -> int:
    return _check(_LIBC.inotify_add_watch(fd, os.fsencode(path), mask),
                  f"inotify_add_watch {path}")


def inotify_rm_watch(fd: int, wd: int) -> None:
    _LIBC.inotify_rm_watch(fd, wd)  # gone already if what it watched went


_SYS_QUOTACTL_FD = 443  # x86_64, Linux 5.14+; glibc has no wrapper


def quotactl_fd(fd: int, cmd: int, id: int, buf: ctypes.Array) -> None:
    """quotactl_fd(2) on the file system `fd` is on: `buf` is read and written in place."""
    _check(_LIBC.syscall(_SYS_QUOTACTL_FD, ctypes.c_int(fd), ctypes.c_uint(cmd),
                         ctypes.c_uint(id), buf), "quotactl_fd")
