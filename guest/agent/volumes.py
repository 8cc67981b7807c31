"""The pod's own volumes in the guest: its emptyDirs (shim/host/emptydir.py), directories
on the scratch disk under VOLUMES that the containers' binds name. The shim says which
directories a container needs, each volume's before its subPaths', with the owner and
mode kubelet gave them; the agent makes those not there yet and leaves the others as
the pod's containers left them. They go with the pod. Each volume is a quota project of
its own, bounded by its sizeLimit when it has one (quota.py).

A container of the pod may put a link in a volume where another container's subPath
is to be: every part of the path is opened without following links, and one that is a
link, or no directory, refuses the container (as kubelet refuses such a subPath)."""
from __future__ import annotations

import errno
import os
from collections.abc import Mapping, Sequence
from typing import Protocol

from podvm_core.protocol import GUEST_VOLUMES
from podvm_core.ttrpc import Code, TtrpcError

from . import quota, writable

VOLUMES = GUEST_VOLUMES  # on the scratch disk, mounted at writable.SCRATCH
_OPEN = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class LocalDir(Protocol):  # the request's message (agent.proto LocalDir)
    path: str
    mode: int
    uid: int
    gid: int


def make(dirs: Sequence[LocalDir], limits: Mapping[str, int] | None = None) -> None:
    """Each of `dirs` there: made, owned and given its mode when it was not; a volume
    made now bounded by its limit in `limits` (volume name -> bytes), if any."""
    if not dirs:
        return
    writable.mount_scratch()
    os.makedirs(VOLUMES, mode=0o700, exist_ok=True)
    for d in dirs:
        parts = d.path.split("/")
        if any(p in ("", ".", "..") or "\0" in p for p in parts):
            raise TtrpcError(Code.INVALID_ARGUMENT, f"volume directory {d.path!r}: not a "
                             f"relative path of plain names")
        fd = os.open(VOLUMES, _OPEN)
        for i, part in enumerate(parts):  # each step closes the directory it starts from
            fd = _step(fd, part, d if i == len(parts) - 1 else None, d.path,
                       (limits or {}).get(part) if len(parts) == 1 else _NOT_A_VOLUME)
        os.close(fd)


_NOT_A_VOLUME = -1


def _step(parent: int, name: str, make_as: LocalDir | None, path: str,
          limit: int | None) -> int:
    """The directory `name` in `parent` (closed), opened; made as `make_as` says when
    it is not there and is the last part, and then a quota project of at most `limit`
    bytes unless it is _NOT_A_VOLUME (a subPath's directory inherits its volume's)."""
    try:
        try:
            return os.open(name, _OPEN, dir_fd=parent)
        except FileNotFoundError:
            if make_as is None:
                raise
        try:
            os.mkdir(name, 0o700, dir_fd=parent)
        except FileExistsError:
            return os.open(name, _OPEN, dir_fd=parent)
        fd = os.open(name, _OPEN, dir_fd=parent)
        try:
            if limit != _NOT_A_VOLUME:
                quota.new_project(fd, limit, f"emptyDir {name}", writable.PROJECT_ROOTS)
            os.fchown(fd, make_as.uid, make_as.gid)
            os.fchmod(fd, make_as.mode & 0o7777)
        except BaseException:  # made now: nothing of it stays half made
            os.close(fd)
            os.rmdir(name, dir_fd=parent)
            raise
        return fd
    except OSError as exc:
        why = ("is a link or no directory" if exc.errno in (errno.ENOTDIR, errno.ELOOP)
               else exc.strerror)  # ELOOP: O_NOFOLLOW met a link
        raise TtrpcError(Code.FAILED_PRECONDITION,
                         f"volume directory {path}: {name} {why}") from None
    finally:
        os.close(parent)
