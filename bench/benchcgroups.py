"""Host cgroups the reservation benches make, as kubelet would, under a private parent
named after the bench's pid (`<prefix><pid>`), on cgroup v1 or v2: the parent's weight,
a pod cgroup's CPU weight and quota, CPU time used, and removal (also of what a killed
run left: its pid is gone)."""
from __future__ import annotations

import contextlib
import os
import pathlib

import cgroups
from cgroups import shares_to_weight
from testbed.cgroupdirs import remove_below

PERIOD_US = 100_000


def hierarchy_roots(manager: cgroups.CgroupManager) -> list[str]:
    if isinstance(manager, cgroups.CgroupV2Manager):
        return [manager.hierarchy.directory("/")]
    return [h.directory("/") for h in manager.hierarchies]


def directory(manager: cgroups.CgroupManager, controller: str, path: str) -> str | None:
    """Where `path` is in the hierarchy that has `controller` (v2: the unified one);
    None on a v1 host without that controller."""
    if isinstance(manager, cgroups.CgroupV2Manager):
        return manager.hierarchy.directory(path)
    h = next((h for h in manager.hierarchies if controller in h.controllers), None)
    return None if h is None else h.directory(path)


def outweigh_the_rest(manager: cgroups.CgroupManager, parent: str) -> None:
    """The parent gets the largest CPU weight there is. A group's weight is split over
    the CPUs by where its threads run, so a target alone on its CPU carries a small
    part of it; at the default weight, any other work on this machine (outside the
    experiment) would take most of that CPU and the figures would be about it."""
    where = directory(manager, "cpu", parent)
    if where is None:
        return
    v2 = isinstance(manager, cgroups.CgroupV2Manager)
    with contextlib.suppress(FileNotFoundError):
        pathlib.Path(where, "cpu.weight" if v2 else "cpu.shares").write_text(
            "10000" if v2 else "262144")


def set_pod_cpu(manager: cgroups.CgroupManager, path: str, shares: int,
                limit: float | None) -> None:
    """kubelet's CPU settings of a pod cgroup: the weight from the requests (`shares`,
    1024 per CPU) and the CFS quota from the limits (None: none)."""
    where = directory(manager, "cpu", path)
    if where is None:
        raise cgroups.ControllerUnavailable(["cpu"], path, ["cpu_shares"])
    quota = round(limit * PERIOD_US) if limit else None
    if isinstance(manager, cgroups.CgroupV2Manager):
        pathlib.Path(where, "cpu.weight").write_text(str(shares_to_weight(shares)))
        pathlib.Path(where, "cpu.max").write_text(f"{quota or 'max'} {PERIOD_US}")
        return
    pathlib.Path(where, "cpu.shares").write_text(str(shares))
    pathlib.Path(where, "cpu.cfs_quota_us").write_text("-1")
    pathlib.Path(where, "cpu.cfs_period_us").write_text(str(PERIOD_US))
    pathlib.Path(where, "cpu.cfs_quota_us").write_text(str(quota or -1))


def cpu_seconds(manager: cgroups.CgroupManager, path: str) -> float:
    """CPU time used by the cgroup's threads so far (v1 cpuacct.usage, v2 cpu.stat)."""
    if isinstance(manager, cgroups.CgroupV2Manager):
        stat = pathlib.Path(manager.hierarchy.directory(path), "cpu.stat").read_text()
        usec = next(int(line.split()[1]) for line in stat.splitlines()
                    if line.startswith("usage_usec "))
        return usec / 1e6
    where = directory(manager, "cpuacct", path)
    if where is None:
        raise cgroups.ControllerUnavailable(["cpuacct"], path, ["cpu usage"])
    return int(pathlib.Path(where, "cpuacct.usage").read_text()) / 1e9


def remove_tree(manager: cgroups.CgroupManager, path: str) -> None:
    """rmdir a cgroup and everything under it, deepest first, in every hierarchy."""
    for root in hierarchy_roots(manager):
        remove_below(os.path.join(root, path.lstrip("/")))


def stale(directory: str, prefix: str) -> list[str]:
    """Names in `directory` left by runs that were killed (`<prefix><pid>[-...]`, the
    pid gone)."""
    found = []
    for name in os.listdir(directory):
        pid = name.removeprefix(prefix).split("-")[0]
        if name.startswith(prefix) and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            found.append(name)
    return found


def sweep_stale(manager: cgroups.CgroupManager, prefix: str) -> None:
    """The parent cgroups of killed runs, with everything under them."""
    for root in hierarchy_roots(manager):
        for name in stale(root, prefix):
            with contextlib.suppress(OSError):
                remove_tree(manager, "/" + name)
