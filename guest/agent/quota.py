"""Each container's writable layer and each disk emptyDir bounded by its own number on the
pod's scratch disk (issue 44). The host bounds the pod's disk as a whole; here each part
is an ext4 project: its directory gets a project id of its own with PROJINHERIT (what is
made in it inherits the id, so everything it holds is charged to it), and the project's
hard block limit is the container's ephemeral-storage limit or the emptyDir's sizeLimit.
A writer past it gets EDQUOT ("Disk quota exceeded"), as under runc on xfs with project
quotas; statfs in it (df) shows the limit as the size. Those with no number get a project
too, counted and unbounded but by the disk.

The numbers come from the pod annotation podvm-webhook writes (ANNOTATION), which
containerd copies into each container's spec; the container's name is containerd's
CONTAINER_NAME annotation. The shim checks the same annotation when it plans the pod
(shim/resources/storage.py); this reader is the guest's own."""
from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import os
import struct
from collections.abc import Sequence

from podvm_core.ttrpc import Code, TtrpcError

from . import libc

ANNOTATION = "storage.podvm.io/limits"
CONTAINER_NAME = "io.kubernetes.cri.container-name"
_KEYS = ("containers", "emptyDirs", "unbounded")

FS_IOC_FSGETXATTR = 0x801C581F
FS_IOC_FSSETXATTR = 0x401C5820
FS_XFLAG_PROJINHERIT = 0x200
_FSXATTR = struct.Struct("=5I8x")  # xflags, extsize, nextents, projid, cowextsize
PRJQUOTA = 2
Q_SETQUOTA = 0x800008
QIF_BLIMITS = 1
_DQBLK = struct.Struct("=8QI4x")  # struct if_dqblk: limits in 1 KiB blocks
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def limits(spec: dict) -> tuple[int | None, dict[str, int]]:
    """(the container's own limit, the pod's emptyDirs' limits), in bytes, from `spec`'s
    annotations; (None, {}) when the pod has none."""
    annotations = spec.get("annotations") or {}
    raw = annotations.get(ANNOTATION)
    if raw is None:
        return None, {}
    try:
        value = json.loads(raw)
    except ValueError as exc:
        raise _bad(f"not JSON: {exc}") from None
    if not isinstance(value, dict) or set(value) - set(_KEYS):
        raise _bad(f"not an object of {', '.join(_KEYS)}")
    containers = _sizes(value.get("containers", {}), "containers")
    empty_dirs = _sizes(value.get("emptyDirs", {}), "emptyDirs")
    name = annotations.get(CONTAINER_NAME)
    return (containers.get(name) if isinstance(name, str) else None), empty_dirs


def _sizes(value: object, key: str) -> dict[str, int]:
    if not isinstance(value, dict) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value.values()):
        raise _bad(f"{key} is not an object of name: bytes")
    return value


def _bad(why: str) -> TtrpcError:
    return TtrpcError(Code.INVALID_ARGUMENT, f"annotation {ANNOTATION}: {why}")


def new_project(fd: int, limit: int | None, what: str, roots: Sequence[str]) -> None:
    """The empty directory `fd` made a project of its own, bounded by `limit` bytes (None:
    counted only), with an id no directory directly in `roots` has. A disk without
    project quotas (a blank file system made before them) takes no project, and refuses
    a limit."""
    project = _free_id(roots)
    try:
        xflags, extsize, nextents, _, cow = _FSXATTR.unpack(
            fcntl.ioctl(fd, FS_IOC_FSGETXATTR, bytes(_FSXATTR.size)))
        fcntl.ioctl(fd, FS_IOC_FSSETXATTR, _FSXATTR.pack(
            xflags | FS_XFLAG_PROJINHERIT, extsize, nextents, project, cow))
        # set even without a limit: the id may have bounded an earlier owner
        blocks = 0 if limit is None else max(1, -(-limit // 1024))  # 0 would be none
        buf = ctypes.create_string_buffer(_DQBLK.pack(blocks, 0, 0, 0, 0, 0, 0, 0,
                                                      QIF_BLIMITS), _DQBLK.size)
        libc.quotactl_fd(fd, Q_SETQUOTA << 8 | PRJQUOTA, project, buf)
    except OSError as exc:
        unquoted = exc.errno in (errno.EOPNOTSUPP, errno.ESRCH, errno.ENOTTY)
        if limit is None and unquoted:
            return
        raise TtrpcError(Code.FAILED_PRECONDITION, f"{what}: its limit of {limit} bytes: "
                         f"{exc.strerror}" + (" (the scratch disk's file system has no "
                                              "project quotas: a blank made before them)"
                                              if unquoted else "")) from None


def _free_id(roots: Sequence[str]) -> int:
    """The smallest project id above 0 that no directory directly in `roots` has."""
    used = set()
    for root in roots:
        try:
            parent = os.open(root, _DIR)
        except FileNotFoundError:
            continue
        try:
            for name in os.listdir(parent):
                try:
                    fd = os.open(name, _DIR, dir_fd=parent)
                except OSError:
                    continue  # no directory: no project of ours
                try:
                    used.add(_FSXATTR.unpack(fcntl.ioctl(fd, FS_IOC_FSGETXATTR,
                                                         bytes(_FSXATTR.size)))[3])
                except OSError:
                    pass
                finally:
                    os.close(fd)
        finally:
            os.close(parent)
    project = 1
    while project in used:
        project += 1
    return project
