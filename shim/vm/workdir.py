"""QEMU's work directory, which QEMU (and virtiofsd, whose socket and log are there) can
write: every file the shim reads, writes, connects to or removes there is reached
beneath a descriptor of the directory and never through a link, so a VMM a guest took
over cannot turn the shim's root against the host. A name QEMU planted as a symlink is
refused (ELOOP), a FIFO is opened without blocking and refused as no regular file, a
new file is made new (O_EXCL) and renamed over the name (podvm_core/atomic.py), a
socket is connected through the descriptor the name gave. The directory's own path is
the shim's (its parent is the pod's state directory, which QEMU cannot see): only the
names in it are QEMU's.

A pod's work directory is also a tmpfs of its own (`bound`), of a few MiB and a few
dozen files: what a QEMU taken over writes there fills that, not the node's /run."""
from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator

from podvm_core.atomic import replace_at

from ..host import mounts

NO_FOLLOW = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC

SLACK_BYTES = 1 << 20
"""Room beyond the logs: QEMU's pid file and sockets, virtiofsd's socket."""
FILES = 64
"""The most files (inodes) the directory holds: a dozen are used."""


def bound(path: str, logs: int) -> None:
    """A tmpfs of `logs` bytes (vmmlog.room_for) and SLACK_BYTES, and of FILES files,
    mounted on the shim's directory `path`
    (not yet used), unless it is a mount point already. The pod's shim daemon makes it in
    the pod's own mount namespace (shim/host/mountns.py): the shim, QEMU and virtiofsd
    see it, the node does not, and it goes with the namespace's last process if the
    shim cannot `unbound` it. Its pages are charged to the memory cgroup of whoever
    wrote them: QEMU's, the pod's."""
    if os.path.ismount(path):
        return
    mounts.mount(mounts.Mount("tmpfs", "podvm-vm", (
        f"size={logs + SLACK_BYTES}", f"nr_inodes={FILES}", "mode=0700", "nosuid", "nodev", "noexec")),
        path)


def unbound(path: str) -> None:
    """The tmpfs `bound` mounted on `path` detached, with what was in it."""
    mounts.unmount(path)


def open_dir(path: str) -> int:
    """A descriptor of the directory `path` (not of what a symlink there leads to)."""
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)


@contextlib.contextmanager
def entry(path: str) -> Iterator[tuple[int, str]]:
    """(descriptor of `path`'s directory, `path`'s name in it) while in the block."""
    directory, name = os.path.split(path)
    fd = open_dir(directory or ".")
    try:
        yield fd, name
    finally:
        os.close(fd)


def read_tail(path: str, size: int) -> bytes:
    """The last `size` bytes of the regular file `path`; OSError for anything else (a
    symlink: ELOOP; a FIFO, a socket, a directory: EINVAL)."""
    with entry(path) as (dirfd, name):
        fd = os.open(name, os.O_RDONLY | NO_FOLLOW, dir_fd=dirfd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, f"{path} is not a regular file")
        return os.pread(fd, size, max(0, st.st_size - size))
    finally:
        os.close(fd)


def create(path: str) -> tuple[int, int]:
    """(descriptor of `path`'s directory, of a new empty file that replaced `path`,
    read-write): what was there (a link included) is replaced, never opened."""
    directory, name = os.path.split(path)
    dirfd = open_dir(directory or ".")
    try:
        return dirfd, replace_at(dirfd, name)
    except BaseException:
        os.close(dirfd)
        raise


def unlink(path: str) -> None:
    """`path` removed (the name itself, a link too: unlinkat follows none); gone already
    is as removed."""
    try:
        with entry(path) as (dirfd, name):
            os.unlink(name, dir_fd=dirfd)
    except FileNotFoundError:
        pass


@contextlib.contextmanager
def socket_path(path: str) -> Iterator[str]:
    """A path to connect to that leads to the unix socket at `path` and nowhere else:
    /proc/self/fd/N of a descriptor opened without following a link. A planted
    `qmp.sock -> /run/containerd/containerd.sock` is the link itself to O_PATH, no
    socket: ENOTSOCK, as for anything else; FileNotFoundError while it is not there."""
    with entry(path) as (dirfd, name):
        fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dirfd)
    try:
        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
            raise OSError(errno.ENOTSOCK, f"{path} is not a socket")
        yield f"/proc/self/fd/{fd}"
    finally:
        os.close(fd)
