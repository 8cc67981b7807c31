"""A container's writable layer in the guest: its root is an overlay the agent makes, of
its image in the pod's share (read only to it) under an upper directory of its own on
the pod's scratch disk (shim/vm/scratchdisk.py). Creating, changing, renaming and
removing files then never leaves the guest: no request crosses to the host's file
server, and the layer has ext4's semantics (locks, sockets, FIFOs, xattrs, nanosecond
times). What a container reads of its image still comes from the share.

The disk is found by its serial (shim/vm/qemu/command.py SCRATCH_SERIAL), mounted at
the first container that needs it; a container's layer (under LAYERS) goes with the
container. The pod's own volumes are on the disk too (volumes.py). Each layer is a quota
project of its own, bounded by the container's ephemeral-storage limit (quota.py); the
disk is mounted with project quotas enforced (prjquota)."""
from __future__ import annotations

import errno
import fcntl
import os
import re
import struct

from podvm_core.protocol import GUEST_VOLUMES
from podvm_core.ttrpc import Code, TtrpcError

from . import libc, quota

SCRATCH = "/run/podvm/scratch"
LAYERS = f"{SCRATCH}/layers"
SERIAL = "podvm-scratch"
PROJECT_ROOTS = (LAYERS, GUEST_VOLUMES)
"""Where the directories that are quota projects are (quota.new_project)."""
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
"""A container id that is one path component (containerd's are narrower still)."""
# noinit_itable: the blank file system's inode tables are left to be zeroed lazily,
# which would write the whole disk's tables from translated code; unused inodes are
# marked so in the group descriptors, so nothing reads them. Not `discard`: a discard
# for every file removed made unlink 30 times slower; the disk is trimmed once when a
# layer goes instead (FITRIM), which punches what it freed out of the host's file.
_SCRATCH_OPTIONS = "noinit_itable"
_QUOTAS = "prjquota"
FITRIM = 0xC0185879  # _IOWR('X', 121, struct fstrim_range)


def scratch_device(sys_block: str = "/sys/block") -> str:
    """/dev/<name> of the virtio disk whose serial is SERIAL."""
    for name in sorted(os.listdir(sys_block)):
        try:
            with open(os.path.join(sys_block, name, "serial")) as f:
                if f.read().strip() == SERIAL:
                    return f"/dev/{name}"
        except OSError:
            continue
    raise TtrpcError(Code.FAILED_PRECONDITION, "the pod's scratch disk (a virtio disk with "
                     f"serial {SERIAL}) is not in the guest")


def mount_scratch() -> None:
    """The scratch disk mounted at SCRATCH (once)."""
    if os.path.ismount(SCRATCH):
        return
    os.makedirs(SCRATCH, mode=0o700, exist_ok=True)
    device = scratch_device()
    try:
        try:
            libc.mount(device, SCRATCH, "ext4", libc.MS_NOATIME,
                       f"{_SCRATCH_OPTIONS},{_QUOTAS}")
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            # a blank made before project quotas: its pods run, and a limit is refused
            libc.mount(device, SCRATCH, "ext4", libc.MS_NOATIME, _SCRATCH_OPTIONS)
    except OSError as exc:
        raise TtrpcError(Code.FAILED_PRECONDITION, f"the pod's scratch disk: {exc}") from None


def layer_dir(container_id: str) -> str:
    if not _ID.fullmatch(container_id):
        raise TtrpcError(Code.INVALID_ARGUMENT, f"container id {container_id!r}: not one "
                         f"path component of letters, digits, '_', '.' and '-'")
    return os.path.join(LAYERS, container_id)


def make(container_id: str, lower: str, root: str, limit: int | None = None) -> None:
    """The container's root at `root`: an overlay of `lower` under a new writable layer
    of at most `limit` bytes (None: bounded by the disk alone). All or nothing; a layer
    left by an earlier container of the same id is emptied."""
    layer = layer_dir(container_id)
    if not os.path.isdir(lower):
        raise TtrpcError(Code.INVALID_ARGUMENT,
                         f"container {container_id}: image {lower!r} is not shared")
    mount_scratch()
    _remove_tree(layer)
    upper, work = os.path.join(layer, "upper"), os.path.join(layer, "work")
    try:
        os.makedirs(layer, mode=0o755)
        fd = os.open(layer, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:  # before upper and work: both inherit it (overlayfs renames between them)
            quota.new_project(fd, limit, f"container {container_id}", PROJECT_ROOTS)
        finally:
            os.close(fd)
        os.mkdir(upper, 0o755)
        os.mkdir(work, 0o700)
        os.makedirs(root, mode=0o755, exist_ok=True)
        # lower/.: over virtio-fs the image is a submount of the share, mounted when a
        # path goes through it (a path that ends on it names the automount point,
        # which overlayfs refuses)
        libc.mount("overlay", root, "overlay", 0,
                   f"lowerdir={lower}/.,upperdir={upper},workdir={work}")
    except TtrpcError:
        _remove_tree(layer)
        raise
    except OSError as exc:
        _remove_tree(layer)
        raise TtrpcError(Code.FAILED_PRECONDITION, f"container {container_id}: its "
                         f"writable layer: {exc}{_kernel_says('overlayfs')}") from None


def remove(container_id: str, root: str) -> None:
    """The container's root unmounted and its layer deleted; a no-op for what is gone."""
    unmount(root)
    forget(container_id)


def unmount(root: str) -> None:
    """The container's root unmounted (its overlay, over its image's files on the host)."""
    try:
        libc.umount(root)
    except OSError:
        pass  # never made, or gone already
    try:
        os.rmdir(root)
    except OSError:
        pass


def forget(container_id: str) -> None:
    """What the container wrote deleted, and the disk's freed blocks given back: the
    longest part of a removal (a trim walks the whole file system), which the agent does
    after it has answered (guest/agent/service.py, RemoveContainer)."""
    _remove_tree(layer_dir(container_id))
    _trim()


def _trim() -> None:
    """The scratch disk's free space given back to the host."""
    try:
        fd = os.open(SCRATCH, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        fcntl.ioctl(fd, FITRIM, struct.pack("QQQ", 0, (1 << 64) - 1, 0))
    except OSError:
        pass  # a disk without discard keeps its blocks until the pod goes
    finally:
        os.close(fd)


def _kernel_says(prefix: str) -> str:
    """The kernel's last lines starting with `prefix` (overlayfs says there why a mount
    is refused: mount(2) gives only EINVAL)."""
    lines = []
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return ""
    try:
        while True:
            try:
                record = os.read(fd, 8192).decode(errors="replace")
            except BlockingIOError:
                break
            except OSError:  # EPIPE: a record was overwritten; go on with the next
                continue
            text = record.split(";", 1)[-1].strip()
            if text.startswith(prefix):
                lines.append(text)
    finally:
        os.close(fd)
    return f" (the kernel: {'; '.join(lines[-3:])})" if lines else ""


def _remove_tree(path: str) -> None:
    if os.path.lexists(path):
        import shutil  # only when a layer goes: the agent boots without it

        shutil.rmtree(path, ignore_errors=True)
