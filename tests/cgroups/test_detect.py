"""Which manager a host gets, from its mounts."""
from __future__ import annotations

import pytest

from cgroups import (CgroupV1Manager, CgroupV2Manager, NoCgroupHierarchy, choose_manager,
                     detect, manager_from_state)
from cgroups.mounts import parse_mountinfo
from cgroups.procs import UNIFIED, parse_proc_cgroup
from testbed.prereqs import require

KNOWN = frozenset({"cpu", "cpuacct", "cpuset", "memory", "devices", "pids", "blkio",
                   "freezer", "hugetlb", "net_cls", "net_prio", "perf_event"})

HYBRID = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct
33 31 0:31 / /sys/fs/cgroup/cpuset rw,relatime - cgroup cgroup rw,cpuset
34 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
35 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,xattr,name=systemd
36 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw,nsdelegate
37 31 0:32 /kubepods /mnt/mem\\040bind rw,relatime - cgroup cgroup rw,memory
"""
UNIFIED_ONLY = """\
30 23 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime - cgroup2 cgroup2 rw,nsdelegate
"""


def test_mountinfo_hierarchies_co_mounts_and_duplicates():
    found = parse_mountinfo(HYBRID, KNOWN)
    by_mount = {h.mountpoint: h for h in found}
    assert by_mount["/sys/fs/cgroup/cpu,cpuacct"].controllers == {"cpu", "cpuacct"}
    assert by_mount["/sys/fs/cgroup/unified"].version == 2
    assert by_mount["/sys/fs/cgroup/systemd"].controllers == frozenset()
    assert "/mnt/mem bind" not in by_mount  # the memory hierarchy's second mount


def test_a_mount_of_a_subtree_maps_hierarchy_paths_below_its_root():
    h = parse_mountinfo("37 31 0:32 /kubepods /mnt/m rw - cgroup cgroup rw,memory", KNOWN)[0]
    assert h.directory("/kubepods/pod1") == "/mnt/m/pod1"
    assert h.directory("/kubepods") == "/mnt/m"
    with pytest.raises(Exception):
        h.directory("/system.slice")


def test_a_hybrid_host_uses_v1():
    manager = choose_manager(parse_mountinfo(HYBRID, KNOWN))
    assert isinstance(manager, CgroupV1Manager)
    assert manager.controllers == {"cpu", "cpuacct", "cpuset", "memory"}
    assert manager_from_state(manager.to_state()).to_state() == manager.to_state()


def test_a_unified_host_uses_v2(tmp_path):
    (tmp_path / "cgroup.controllers").write_text("cpu memory pids\n")
    text = UNIFIED_ONLY.replace("/sys/fs/cgroup", str(tmp_path))
    manager = choose_manager(parse_mountinfo(text, KNOWN), root=str(tmp_path))
    assert isinstance(manager, CgroupV2Manager)
    assert manager.controllers == {"cpu", "memory", "pids"}
    assert manager_from_state(manager.to_state()).to_state() == manager.to_state()


def test_no_usable_hierarchy_is_a_clear_error():
    text = "35 31 0:37 / /sys/fs/cgroup/cpuset rw - cgroup cgroup rw,cpuset\n"
    with pytest.raises(NoCgroupHierarchy, match="cpu and memory needed"):
        choose_manager(parse_mountinfo(text, KNOWN))


def test_proc_cgroup_lines():
    seen = parse_proc_cgroup("5:cpu,cpuacct:/a\n4:memory:/b\n9:name=systemd:/\n0::/c\n")
    assert seen == {"cpu": "/a", "cpuacct": "/a", "memory": "/b", "name=systemd": "/",
                    UNIFIED: "/c"}


def test_this_host():
    """This machine: v1 hierarchies per controller plus an empty cgroup2 at unified."""
    try:
        manager = detect()
    except NoCgroupHierarchy as err:
        require(False, f"a cgroup hierarchy ({err})")
        return
    with open("/proc/self/mountinfo") as f:
        v2_root = any(line.split(" - ")[1].startswith("cgroup2") and
                      line.split()[4] == "/sys/fs/cgroup" for line in f)
    assert isinstance(manager, CgroupV2Manager if v2_root else CgroupV1Manager)
