"""Which manager this host needs, decided from what is mounted: cgroup v2 when the cgroup
root is a cgroup2 mount, v1 when per-controller hierarchies for cpu and memory are there
(a hybrid host's empty cgroup2 at <root>/unified does not count: runc uses v1 there)."""
from __future__ import annotations

import os
from typing import Iterable

from .errors import CgroupError, NoCgroupHierarchy
from .manager import CgroupManager
from .mounts import MOUNTINFO, PROC_CGROUPS, Hierarchy, host_hierarchies
from .v1 import CgroupV1Manager
from .v2 import CgroupV2Manager

CGROUP_ROOT = "/sys/fs/cgroup"
V1_REQUIRED = frozenset({"cpu", "memory"})


def detect(root: str = CGROUP_ROOT, mountinfo: str = MOUNTINFO,
           proc_cgroups: str = PROC_CGROUPS) -> CgroupManager:
    """The manager for this host. `root` lets a test point at another cgroup2 mount (a
    hybrid host's /sys/fs/cgroup/unified) or another place v1 hierarchies are under."""
    return choose_manager(host_hierarchies(mountinfo, proc_cgroups), root)


def choose_manager(hierarchies: Iterable[Hierarchy], root: str = CGROUP_ROOT) -> CgroupManager:
    root = os.path.normpath(root)
    found = list(hierarchies)
    for h in found:
        if h.version == 2 and os.path.normpath(h.mountpoint) == root:
            return CgroupV2Manager(mountpoint=h.mountpoint, root=h.root)
    v1 = [h for h in found if h.version == 1 and _under(h.mountpoint, root)]
    have = frozenset().union(*(h.controllers for h in v1)) if v1 else frozenset()
    if V1_REQUIRED <= have:
        return CgroupV1Manager(v1)
    raise NoCgroupHierarchy(
        f"no cgroup hierarchy to use under {root}: it is not a cgroup2 mount, and cgroup v1 "
        f"has {', '.join(sorted(have)) or 'no controllers'} there (cpu and memory needed)")


def _under(path: str, root: str) -> bool:
    path = os.path.normpath(path)
    return path == root or path.startswith(root.rstrip("/") + "/")


def manager_from_state(state: dict) -> CgroupManager:
    """The manager `to_state()` described, without probing the host again (after a crash
    the shim that made the cgroups is gone, the mounts are not)."""
    version = state.get("version")
    if version == 1:
        return CgroupV1Manager(Hierarchy.from_state(h) for h in state["hierarchies"])
    if version == 2:
        return CgroupV2Manager(mountpoint=state["mountpoint"], root=state.get("root", "/"))
    raise CgroupError(f"persisted cgroup state has unknown version {version!r}")
