"""The pod's emptyDir volumes, found among a container's host binds: kubelet makes each
one a directory `<root>/pods/<pod uid>/volumes/kubernetes.io~empty-dir/<name>`, and a
subPath of one a bind at `<root>/pods/<pod uid>/volume-subpaths/<name>/<container>/<n>`
of a directory it made inside it. An emptyDir on a disk lives in the guest instead, on
the pod's scratch disk (guest/agent/volumes.py), as Kata Containers keeps it: it is the
pod's alone, starts empty and goes with the pod, so nothing needs the host to hold it.
One kept in memory (`medium: Memory`, a tmpfs kubelet mounted) stays a host bind.

What the guest is told is the directories to make, the volume's first, each with the
owner and mode kubelet gave it on the host (0777; fsGroup's group and set-group-ID when
the pod has one); nothing of the host's directory is read but those. Looked up in the
host's mount namespace (shim/host/mountns.py), where kubelet's subPath binds are."""
from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass

from . import mounts

PLUGIN = "kubernetes.io~empty-dir"
_VOLUME = re.compile(rf"(?P<pod>/.*/pods/[^/]+)/volumes/{re.escape(PLUGIN)}/(?P<name>[^/]+)")
_SUBPATH = re.compile(r"(?P<pod>/.*/pods/[^/]+)/volume-subpaths/(?P<name>[^/]+)/[^/]+/[0-9]+")
SUBPATH_SCAN_LIMIT = 10_000
"""Entries of a host emptyDir looked at to find a subPath (kubelet's directories only:
the files the pod writes are in the guest)."""


@dataclass(frozen=True)
class LocalDir:
    path: str
    """Relative to the guest's volumes: the volume's name, then its subPath's parts."""
    mode: int
    """Permission bits with set-group-ID and sticky."""
    uid: int
    gid: int


def local_dirs(source: str) -> tuple[LocalDir, ...] | None:
    """The guest's directories for a bind of `source` when it is a disk emptyDir or a
    subPath of one (the last one is what is mounted); None when it is neither.
    ValueError when a subPath of an emptyDir is not a directory kubelet made in it."""
    source = os.path.normpath(source)
    if not (_VOLUME.fullmatch(source) or _SUBPATH.fullmatch(source)):
        return None  # most binds: not worth a fork into the host's namespace
    from . import mountns  # here: only a container with an emptyDir needs it

    host = mountns.host_namespace_fd()
    found = (_local_dirs(source) if host is None else
             mountns.in_namespace(host, _local_dirs, source))
    if isinstance(found, str):
        raise ValueError(found)
    return None if found is None else tuple(LocalDir(*d) for d in found)


def _local_dirs(source: str) -> list[list] | str | None:
    """As local_dirs, JSON-able (run in the host's namespace): an error as a string."""
    volume, name = source, ""
    match = _VOLUME.fullmatch(source)
    if match:
        name = match["name"]
    else:
        match = _SUBPATH.fullmatch(source)
        assert match is not None
        name = match["name"]
        volume = f"{match['pod']}/volumes/{PLUGIN}/{name}"
    if not os.path.isdir(volume) or mounts.fstype_of(volume) == "tmpfs":
        return None  # a subPath of another kind of volume, or an emptyDir in memory
    found = [_dir(name, volume)]
    if volume != source:
        relative = _find(volume, os.stat(source))
        if relative is None:
            return (f"subPath {source} of emptyDir {name}: not a directory kubelet made "
                    f"in {volume}")
        parts = relative.split("/")
        found += [_dir("/".join([name, *parts[:i + 1]]), os.path.join(volume, *parts[:i + 1]))
                  for i in range(len(parts))]
    return found


def _dir(path: str, host: str) -> list:
    st = os.stat(host, follow_symlinks=False)
    return [path, stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid]


def _find(volume: str, target: os.stat_result) -> str | None:
    """The path in `volume` of the directory `target` is, without following links."""
    if not stat.S_ISDIR(target.st_mode):
        return None
    seen = 0
    for top, dirs, _ in os.walk(volume):
        for d in dirs:
            seen += 1
            st = os.stat(os.path.join(top, d), follow_symlinks=False)
            if (st.st_dev, st.st_ino) == (target.st_dev, target.st_ino):
                return os.path.relpath(os.path.join(top, d), volume)
            if seen >= SUBPATH_SCAN_LIMIT:
                return None
    return None
