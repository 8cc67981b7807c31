"""mount(2) and umount2(2) for the shim: containerd's rootfs mounts onto the bundle; what
is mounted where, from /proc/self/mountinfo (in the daemon: the pod's own mount
namespace, see shim/host/mountns.py). What goes into the directory shared with the guest is
attached through descriptors instead (shim/host/share.py)."""
from __future__ import annotations

import errno
import os
import re
from dataclasses import dataclass
from typing import Iterator

from ..libc import last_errno, libc

MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 0x40000
MNT_DETACH = 0x2
UMOUNT_NOFOLLOW = 0x8

_FLAGS = {"ro": MS_RDONLY, "nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC,
          "bind": MS_BIND, "rbind": MS_BIND | MS_REC}
_IGNORED = {"rw", "suid", "dev", "exec", "defaults"}
_PER_MOUNT = ("ro", "nosuid", "nodev", "noexec")
"""The flags of a mount itself (not of its filesystem) that a bind of it must repeat."""


@dataclass(frozen=True)
class Mount:
    type: str
    source: str
    options: tuple[str, ...] = ()


def split_options(options: tuple[str, ...] | list[str]) -> tuple[int, str]:
    """Mount flags and the data string the filesystem parses itself."""
    flags, data = 0, []
    for opt in options:
        if opt in _FLAGS:
            flags |= _FLAGS[opt]
        elif opt not in _IGNORED:
            data.append(opt)
    return flags, ",".join(data)


def mount(m: Mount, target: str) -> None:
    flags, data = split_options(m.options)
    fstype = None if flags & MS_BIND else m.type
    _mount(m.source, target, fstype, flags & ~MS_RDONLY if flags & MS_BIND else flags, data)
    if flags & MS_BIND and flags & MS_RDONLY:  # a bind is made read-only by a remount
        _mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY, "")


def unmount(path: str) -> bool:
    """Detach whatever is mounted on `path`; False when nothing was (or no such path).
    A symlink at `path` is not followed (one a guest put in a volume leads nowhere)."""
    if libc().umount2(os.fsencode(path), MNT_DETACH | UMOUNT_NOFOLLOW) != 0:
        err = last_errno()
        if err in (errno.EINVAL, errno.ENOENT):
            return False
        raise OSError(err, f"umount {path}: {os.strerror(err)}")
    return True


@dataclass(frozen=True)
class Submount:
    path: str
    """Relative to the directory it is below."""
    options: tuple[str, ...]
    """Its own flags as bind options: "ro" or "rw", then nosuid, nodev, noexec."""


def _mountinfo() -> Iterator[tuple[str, tuple[str, ...], str]]:
    """(mount point, per-mount options, file system type) of every mount in the shim's
    namespace, parents before children and a stacked mount after the one it hides."""
    with open("/proc/self/mountinfo", "rb") as f:
        for line in f:
            fields = line.split()
            point = re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m[1], 8)]), fields[4])
            yield (os.fsdecode(point), tuple(fields[5].decode().split(",")),
                   fields[fields.index(b"-") + 1].decode())


def fstype_of(path: str) -> str:
    """The file system type of the mount `path` (resolved) is on, "" when none is found."""
    path = os.path.realpath(path)
    best, found = "", ""
    for point, _, fstype in _mountinfo():
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):  # the deepest, the last of a stack
            best, found = point, fstype
    return found


def mounts_under(path: str) -> list[str]:
    """Mount points at or below `path`, deepest first (the order to unmount them in)."""
    prefix = path.rstrip("/")
    found = {point for point, _, _ in _mountinfo()
             if point == prefix or point.startswith(prefix + "/")}
    return sorted(found, key=lambda p: p.count("/"), reverse=True)


def submounts(path: str) -> list[Submount]:
    """What is mounted strictly below the directory `path` (none when it is no
    directory), shallowest first, each with its own flags (the top one of a stack); as
    the host sees it (what `bind` clones), also from the pod's own mount namespace."""
    from . import mountns  # here: the idle daemon has no use for it

    host = mountns.host_namespace_fd()
    if host is None:
        return _submounts_here(path)
    return [Submount(p, tuple(o)) for p, o in mountns.in_namespace(host, _submount_pairs, path)]


def _submount_pairs(path: str) -> list[tuple[str, tuple[str, ...]]]:
    return [(s.path, s.options) for s in _submounts_here(path)]


def _submounts_here(path: str) -> list[Submount]:
    if not os.path.isdir(path):
        return []
    prefix = os.path.realpath(path).rstrip("/") + "/"
    found: dict[str, tuple[str, ...]] = {}
    for point, options, _ in _mountinfo():
        if point.startswith(prefix):
            own = tuple(o for o in _PER_MOUNT if o in options)
            found[point[len(prefix):]] = own if "ro" in own else ("rw", *own)
    return [Submount(p, found[p]) for p in sorted(found, key=lambda p: (p.count("/"), p))]


def unmount_all(path: str) -> int:
    """Unmount everything at or below `path`, stacked mounts too (one path may hold
    several, a later one hiding an earlier, e.g. one a crashed shim left); how many."""
    count = 0
    for _ in range(64):  # bounded: a mount that will not go is reported by the caller
        points = mounts_under(path)
        done = sum(unmount(p) for p in points)
        count += done
        if not points or not done:
            break
    return count


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str) -> None:
    if libc().mount(_b(source), os.fsencode(target), _b(fstype), flags,
                  _b(data or None)) != 0:
        err = last_errno()
        raise OSError(err, f"mount {source or ''} on {target} ({fstype or 'bind'}, "
                           f"{data or 'no options'}): {os.strerror(err)}")


def _b(value: str | None) -> bytes | None:
    return None if value is None else os.fsencode(value)
