"""The pod's scratch disk shown where kubelet measures a pod's own files.

A VM pod writes its containers' layers and emptyDirs on its scratch disk, an unnamed
file (shim/vm/scratchdisk.py), so nothing kubelet measures on the host grows with them:
containerd's CRI takes a container's writable layer from its snapshotter, and kubelet
measures emptyDirs in their host directories, and both read about nothing for a VM pod.
kubelet does count, as part of the pod's ephemeral storage, every plain file directly in
the pod's log directory ("for some container runtimes, e.g. kata, gvisor, they may want
to keep some pod level logs ... kubelet will take those logs into account as part of pod
ephemeral storage": kubelet's cri_stats_provider.go, getPodLogStats), by the blocks it
holds. So the disk gets a name there, `podvm-<sandbox>.disk`: its allocated blocks (what
the pod's files hold now: the guest's discards punch holes in it) are what kubelet adds to
the pod's usage, which its eviction compares with the pod's limits and ranks pods by
under disk pressure, and the file is on the node file system kubelet watches.

The directory is containerd's and kubelet's (root's, from the sandbox's
`io.kubernetes.cri.sandbox-log-directory`): no less trusted process writes in it. Even
so, the name is made and removed through a descriptor of the directory, and removed only
while it is still this disk (its device and inode). kubelet removes the directory with
the pod; a shim that dies without removing the name leaves it to that."""
from __future__ import annotations

import errno
import logging
import os
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Shown:
    """A disk's name in a pod's log directory, and the file it names."""
    directory: str
    name: str
    device: int
    inode: int


def name_for(sandbox_id: str) -> str:
    return f"podvm-{sandbox_id[:32]}.disk"


def _open_directory(directory: str) -> int:
    if not os.path.isabs(directory):
        raise OSError(errno.EINVAL, f"pod log directory {directory!r} is not absolute")
    return os.open(directory, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)


def show(disk: str, directory: str, sandbox_id: str) -> Shown | None:
    """Name the unnamed file `disk` (a descriptor's /proc path: /proc/<QEMU's pid>/fd/N)
    in `directory`; None (logged) where it cannot be: no such directory, or another file
    system than the disk's (a link cannot cross one: put `scratch_path` on the file
    system of /var/log/pods, docs/configuration.md)."""
    name = name_for(sandbox_id)
    try:
        dirfd = _open_directory(directory)
    except OSError as exc:
        log.warning("sandbox %s: scratch disk not shown in pod log directory %s: %s",
                    sandbox_id, directory, exc.strerror or exc)
        return None
    try:
        st = os.stat(disk)
        try:
            os.link(disk, name, dst_dir_fd=dirfd, follow_symlinks=True)
        except FileExistsError:  # a name of this sandbox's left by a shim that died
            os.unlink(name, dir_fd=dirfd)
            os.link(disk, name, dst_dir_fd=dirfd, follow_symlinks=True)
        return Shown(directory, name, st.st_dev, st.st_ino)
    except OSError as exc:
        why = ("the scratch disk is on another file system" if exc.errno == errno.EXDEV
               else exc.strerror or str(exc))
        log.warning("sandbox %s: scratch disk not shown in pod log directory %s: %s "
                    "(kubelet does not see what the pod writes)", sandbox_id, directory, why)
        return None
    finally:
        os.close(dirfd)


def hide(shown: Shown | None) -> None:
    """The name gone, if it still names the disk; nothing where it is gone already."""
    if shown is None:
        return
    try:
        dirfd = _open_directory(shown.directory)
    except OSError:
        return  # kubelet removed the pod's directory, and the name with it
    try:
        now = os.stat(shown.name, dir_fd=dirfd, follow_symlinks=False)
        if (now.st_dev, now.st_ino) == (shown.device, shown.inode):
            os.unlink(shown.name, dir_fd=dirfd)
    except FileNotFoundError:
        pass
    finally:
        os.close(dirfd)
