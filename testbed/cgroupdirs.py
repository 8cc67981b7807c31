"""Where a cgroup the tests made is, in each of the host's mounted hierarchies, the
cgroups below it, and their removal: for the harnesses that make and remove them
(testbed/containerd.py, reboot.py, vmconfig.py, bench/benchcgroups.py) and the tests
that check nothing was left."""
from __future__ import annotations

import os


def cgroup_dirs(name: str) -> list[str]:
    """`name` (relative to the root cgroup) in every mounted hierarchy where it exists."""
    found = [os.path.join("/sys/fs/cgroup", name)]  # cgroup v2 mounted at /sys/fs/cgroup
    found += [os.path.join(h, name) for h in
              (os.path.join("/sys/fs/cgroup", e) for e in os.listdir("/sys/fs/cgroup"))]
    unique = {os.path.realpath(d): d for d in found  # cpu,cpuacct links to cpu ...
              if os.path.isfile(os.path.join(d, "cgroup.procs"))}
    return sorted(unique)


def cgroups_below(parent: str) -> list[str]:
    """The cgroups at or below `parent` in every hierarchy."""
    return [w[0] for top in cgroup_dirs(parent.strip("/")) for w in os.walk(top)]


def remove_below(top: str) -> list[str]:
    """The directory `top` (of one hierarchy) and every cgroup below it, deepest first (a
    cgroup goes once it has no tasks and no children): those removed. One gone meanwhile
    is passed over; any other error is raised, what is left of the tree left."""
    removed = []
    for dirpath in sorted((w[0] for w in os.walk(top)), key=lambda d: -d.count("/")):
        try:
            os.rmdir(dirpath)
        except FileNotFoundError:
            continue
        removed.append(dirpath)
    return removed


def remove_cgroup(parent: str) -> list[str]:
    """`parent` (relative to the root cgroup) and every cgroup below it, in each
    hierarchy: those removed (remove_below's)."""
    return [d for top in cgroup_dirs(parent.strip("/")) for d in remove_below(top)]
