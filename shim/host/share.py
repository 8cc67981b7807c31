"""The pod's shared directory: what the guest sees of the host through virtio-fs (or
9p), built by the shim so that a hostile guest cannot steer it.

Two paths in the sandbox's state directory:
- `shared/`: the shim's working tree, a mount with shared propagation. The shim makes
  each container's directory, its `rootfs` and `mounts/<n>-<name>` targets in it, and
  attaches the container's rootfs and host files on them.
- `export/`: a read-only bind of `shared/` (its peer: every mount attached in `shared/`
  appears there too, with its own flags). virtiofsd (or QEMU, over 9p) exports this one.
So the guest writes only inside a container's rootfs (where its writable layer is not
in the guest) and its read-write volumes, as the container could under runc; it cannot
create, remove or replace a single entry of the structure the shim walks (EROFS), and
cannot fill the state directory's tmpfs (the pod's /etc files are bound read-only).

And beneath that, every path the shim makes, mounts on, unmounts or removes is resolved
below a descriptor of `shared/` without following a symlink or crossing a mount it did not
make (shim/host/beneath.py); mounts are attached and detached through descriptors. A guest
that could write the structure anyway (a QEMU without the read-only view) meets ELOOP or
EXDEV, never a path outside.

The mounts live in the pod's own mount namespace (shim/host/mountns.py) and go with it."""
from __future__ import annotations

import errno
import logging
import os
import stat

from ..libc import last_errno, libc
from . import beneath, mountns

log = logging.getLogger("podvm.share")

_DIR_MODE = 0o755  # the guest's containers run as any user: they must reach their root
_HOST_SAFE = beneath.MOUNT_ATTR_NOSUID | beneath.MOUNT_ATTR_NODEV | beneath.MOUNT_ATTR_NOEXEC


class ShareError(OSError):
    """A container's files could not be shared: the message says which and why."""


class Share:
    def __init__(self, state_dir: str) -> None:
        self.tree = os.path.join(state_dir, "shared")
        self.export = os.path.join(state_dir, "export")
        self._root = -1

    @property
    def root_fd(self) -> int:
        """The O_PATH descriptor of `shared/` everything is resolved beneath."""
        if self._root < 0:
            raise ShareError(errno.EBADF, f"the shared directory {self.tree} is not open")
        return self._root

    def create(self) -> None:
        """`shared/` made a mount of its own with shared propagation, and `export/` its
        read-only peer. Again after a failure: what is there already is reused."""
        for path in (self.tree, self.export):
            os.makedirs(path, mode=0o700, exist_ok=True)
        root = os.open(self.tree, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            if not _is_mount_root(root):
                _attach_clone(root, root)
                os.close(root)
                root = os.open(self.tree, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW |
                               os.O_CLOEXEC)
            beneath.set_attributes(root, propagation=beneath.MS_SHARED)
            export = os.open(self.export, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW |
                             os.O_CLOEXEC)
            try:
                if not _is_mount_root(export):
                    tree = beneath.clone_tree("", recursive=False, dirfd=root)
                    try:
                        beneath.set_attributes(tree, attr_set=beneath.MOUNT_ATTR_RDONLY |
                                               beneath.MOUNT_ATTR_NOSUID |
                                               beneath.MOUNT_ATTR_NODEV)
                        beneath.attach(tree, export)
                    finally:
                        os.close(tree)
            finally:
                os.close(export)
        except BaseException:
            os.close(root)
            raise
        self._root = root

    def add(self, container_id: str, rootfs: str, rootfs_from_host: bool,
            binds: list[tuple[str, str, bool, bool]], *,
            rootfs_readonly: bool = False) -> None:
        """The container's directory: `rootfs` attached on `<id>/rootfs`, and each
        (source, name, readonly, recursive_readonly) of `binds` on `<id>/mounts/<name>`.
        Host sources are taken as the host's mount namespace sees them (shim/host/mountns.py);
        `rootfs_from_host` False: it is the shim's own mount. `rootfs_readonly`: the
        container's writable layer is in the guest, which only reads its image here: the
        rootfs is read-only all the way down, so that guest root reaching the share writes
        nothing (setuid files included) into containerd's snapshot on the host, where no
        limit holds it. All or nothing: on failure what was attached is detached and the
        directory removed."""
        container = self._make_container_dir(container_id)
        try:
            target = beneath.make_dir(container, "rootfs", _DIR_MODE)
            try:
                _bind(rootfs, target, rootfs_from_host, rootfs_readonly, rootfs_readonly)
            finally:
                os.close(target)
            if binds:
                mounts = beneath.make_dir(container, "mounts", _DIR_MODE)
                try:
                    for source, name, readonly, recursive in binds:
                        _bind_new_target(source, mounts, name, readonly, recursive)
                finally:
                    os.close(mounts)
        except BaseException:
            os.close(container)
            self.remove(container_id)
            raise
        os.close(container)

    def _make_container_dir(self, container_id: str) -> int:
        try:
            os.mkdir(container_id, _DIR_MODE, dir_fd=self.root_fd)
        except FileExistsError:
            raise ShareError(errno.EEXIST, f"container {container_id} is already shared in "
                                           f"{self.tree}") from None
        except ValueError as exc:  # a NUL byte
            raise ShareError(errno.EINVAL, f"container id {container_id!r}: {exc}") from None
        return beneath.open_dir(self.root_fd, container_id)

    def remove(self, container_id: str) -> None:
        """Detach everything attached for the container and remove its directory; a
        no-op for what is already gone. Only the targets the shim makes are touched."""
        if "/" in container_id or container_id in ("", ".", ".."):
            raise ShareError(errno.EINVAL, f"{container_id!r} is not a container id")
        try:
            container = beneath.open_dir(self.root_fd, container_id)
        except FileNotFoundError:
            return
        except OSError as exc:  # not the directory the shim made: nothing of it is there
            if exc.errno not in (errno.ELOOP, errno.ENOTDIR, errno.EXDEV):
                raise
            log.warning("%s/%s is not the directory podvm made (%s): removed without "
                        "looking inside", self.tree, container_id, exc.strerror)
            beneath.remove_all(self.root_fd, container_id)
            return
        try:
            beneath.detach_all(container, "rootfs")
            try:
                mounts = beneath.openat2(container, "mounts", os.O_RDONLY | os.O_DIRECTORY |
                                         os.O_NOFOLLOW, beneath.SKELETON)
            except FileNotFoundError:
                mounts = -1
            if mounts >= 0:
                try:
                    for name in os.listdir(mounts):
                        beneath.detach_all(mounts, name)
                finally:
                    os.close(mounts)
        finally:
            os.close(container)
        beneath.remove_all(self.root_fd, container_id)

    def destroy(self) -> None:
        """Detach `export/` and `shared/` with all below them, remove both (after every
        container's `remove`). Idempotent."""
        for path in (self.export, self.tree):
            parent = os.open(os.path.dirname(path), os.O_PATH | os.O_DIRECTORY |
                             os.O_CLOEXEC)
            try:
                beneath.detach_all(parent, os.path.basename(path))
                beneath.remove_all(parent, os.path.basename(path))
            except FileNotFoundError:
                pass
            finally:
                os.close(parent)
        if self._root >= 0:
            os.close(self._root)
            self._root = -1


def _is_mount_root(fd: int) -> bool:
    """Whether the directory `fd` is the root of a mount (its parent is another mount)."""
    parent = beneath.openat2(fd, "..", os.O_PATH | os.O_DIRECTORY, 0)
    try:
        return _mount_id(fd) != _mount_id(parent)
    finally:
        os.close(parent)


def _mount_id(fd: int) -> int:
    with open(f"/proc/self/fdinfo/{fd}") as f:
        for line in f:
            if line.startswith("mnt_id:"):
                return int(line.split()[1])
    raise OSError(errno.ENOTSUP, "no mnt_id in /proc/self/fdinfo (Linux 3.15 or later)")


def _attach_clone(source: int, target: int) -> None:
    tree = beneath.clone_tree("", recursive=False, dirfd=source)
    try:
        beneath.attach(tree, target)
    finally:
        os.close(tree)


def _bind_new_target(source: str, mounts: int, name: str, readonly: bool,
                     recursive: bool) -> None:
    """`source` (a host file or directory) on a new target `name` in `mounts`, made as
    the same kind of file."""
    directory = _host_is_dir(source)
    target = beneath.make_dir(mounts, name, _DIR_MODE) if directory else \
        beneath.make_file(mounts, name)
    try:
        _bind(source, target, True, readonly, recursive)
    finally:
        os.close(target)


def _host_is_dir(source: str) -> bool:
    """Whether `source` is a directory as the host's mount namespace sees it."""
    host = mountns.host_namespace_fd()
    if host is None:
        return _is_dir(source)
    return mountns.in_namespace(host, _is_dir, source)


def _is_dir(source: str) -> bool:
    return stat.S_ISDIR(os.stat(source).st_mode)


def _bind(source: str, target: int, from_host: bool, readonly: bool,
          recursive: bool) -> None:
    """A copy of `source`'s mount tree attached on the descriptor `target`: private (no
    later host mount reaches the guest through it), nosuid, nodev and noexec on the host
    (the guest's own mounts of it are the guest's), read-only at its top when
    `readonly`, all the way down when `recursive`."""
    host = mountns.host_namespace_fd() if from_host else None
    if host is None:
        _clone_attach(source, target, readonly, recursive, -1)
        return
    own = os.open("/proc/self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
    try:
        mountns.in_namespace(host, _clone_attach, source, target, readonly, recursive, own)
    finally:
        os.close(own)


def _clone_attach(source: str, target: int, readonly: bool, recursive: bool,
                  back_to: int) -> None:
    """In the namespace `source` is to be read in (a helper of the daemon when that is
    the host's): clone its tree, then (back in the pod's namespace `back_to`, when one is
    given) set its flags and attach it on `target`."""
    tree = beneath.clone_tree(source)
    try:
        if back_to >= 0:
            if libc().setns(back_to, mountns.CLONE_NEWNS) != 0:
                err = last_errno()
                raise OSError(err, f"bind {source}: back into the pod's namespace: "
                                   f"{os.strerror(err)}")
        # QEMU opens, on the guest's word, what the guest names in the share: a device
        # node in an image or a volume would be the host's device, a setuid file the
        # host's; QEMU executes nothing there either.
        beneath.set_attributes(tree, attr_set=_HOST_SAFE, propagation=beneath.MS_PRIVATE,
                               recursive=True)
        if readonly:
            beneath.set_attributes(tree, attr_set=beneath.MOUNT_ATTR_RDONLY,
                                   recursive=recursive)
        beneath.attach(tree, target)
    except OSError as exc:
        raise OSError(exc.errno, f"bind {source}: {exc.strerror}") from None
    finally:
        os.close(tree)
