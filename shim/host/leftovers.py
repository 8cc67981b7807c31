"""Whether a gone shim left anything, told with the standard library alone: `delete` runs
on every container's way out, as a process of its own that containerd kills at 5 s, and
most often its pod's daemon has removed everything already. The removal's own code
(cleanup.py: psutil, the cgroup managers, the network's client) loads only where this
finds something for it."""
from __future__ import annotations

import os
import time

from podvm_core import lightjson

from . import paths, shimstate
from .pids import is_our_shim

STALE_AFTER = 30.0
"""Seconds a state directory without shim.json must be left unchanged before a sweep takes
it for one a killed `delete` half removed (`start` writes shim.json as it makes it)."""


def left_behind(namespace: str, container_id: str, bundle: str) -> bool:
    """Whether the container's `delete` has anything to remove: its pod's state directory
    (which names everything the pod made on the host, and goes last), or a mount on its
    rootfs in this mount namespace (an older podvm made it there). Without the state
    directory no daemon is recorded, and no QEMU nor mount of the pod is left: they go
    before it.

    A workload container of a pod whose daemon lives leaves nothing once the daemon's
    Delete has unshared its files, which it does before it answers (shim/pod/containers.py):
    the daemon's record (sandbox.json) then no longer names the container's rootfs. A
    Delete that failed before leaves it named, and its mounts in the pod's namespace are
    then `delete`'s to remove. containerd 1.6 runs this `delete` inside the pod's
    StopPodSandbox: finding that out with psutil's scan of every process took 3.7 s of
    each of twenty pods stopped at once (issue 47)."""
    group = paths.group_id(paths.read_spec(bundle), container_id)
    if mounted_at_or_under(os.path.join(bundle, "rootfs")):
        return True
    if group != container_id and _unshared_by_its_daemon(namespace, group, container_id):
        return False
    return os.path.lexists(paths.state_dir(namespace, group))


def mounted_at_or_under(path: str) -> bool:
    """Something is mounted at `path` or below it, in this process's mount namespace."""
    point = _escaped(os.path.abspath(path))
    with open("/proc/self/mountinfo", "rb") as f:
        for line in f:
            mount_point = line.split(b" ", 5)[4]
            if mount_point == point or mount_point.startswith(point + b"/"):
                return True
    return False


def _escaped(path: str) -> bytes:
    """`path` as mountinfo writes it: space, tab, newline and backslash in octal."""
    out = os.fsencode(path)
    for char in b"\\ \t\n":
        out = out.replace(bytes([char]), b"\\%03o" % char)
    return out


def anything_abandoned(namespace: str) -> bool:
    """Whether a sandbox of `namespace` has state that no live shim owns: the sweep's
    work (cleanup.sweep_stale, which checks again under each directory's lock)."""
    try:
        groups = os.listdir(os.path.join(paths.STATE_ROOT, namespace))
    except FileNotFoundError:
        return False
    return any(abandoned(paths.state_dir(namespace, group), shimstate.read(namespace, group))
               for group in groups)


def _unshared_by_its_daemon(namespace: str, group: str, container_id: str) -> bool:
    """The pod's daemon lives, and its record names no rootfs of the container (or the pod
    has no record: it never booted, so no container of it was shared)."""
    pid = (shimstate.read(namespace, group) or {}).get("pid")
    if not (isinstance(pid, int) and is_our_shim(pid)):
        return False
    try:
        with open(os.path.join(paths.state_dir(namespace, group), paths.POD_STATE_FILE), "rb") as f:
            record = lightjson.loads(f.read())
    except FileNotFoundError:
        return True
    except (OSError, ValueError):
        return False
    rootfs = record.get("rootfs") if isinstance(record, dict) else None
    return isinstance(rootfs, dict) and container_id not in rootfs


def abandoned(state_dir: str, state: dict | None) -> bool:
    """No live daemon of ours owns `state_dir` (a pid reused by another shim counts as
    live: the sweep keeps what it cannot tell apart)."""
    if state is None:
        try:
            return time.time() - os.stat(state_dir).st_mtime > STALE_AFTER
        except FileNotFoundError:
            return False
    pid = state.get("pid")
    return not (isinstance(pid, int) and is_our_shim(pid))
