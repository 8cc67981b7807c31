"""cgroup v1 limits on this host's hierarchies, checked in the files the kernel exposes."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from cgroups import (QEMU_DEVICES, CgroupLimits, CgroupIOError, CgroupV1Manager,
                     ControllerUnavailable, InvalidLimits, SandboxCgroup)
from testbed.prereqs import require

LIMITS = CgroupLimits(cpu_quota_us=50_000, cpu_period_us=50_000, cpu_shares=512,
                      memory_limit_bytes=256 << 20, pids_limit=64, devices=QEMU_DEVICES)


def read(manager: CgroupV1Manager, controller: str, path: str, name: str) -> str:
    (h,) = [h for h in manager.hierarchies if controller in h.controllers]
    with open(os.path.join(h.mountpoint, path.lstrip("/"), name)) as f:
        return f.read().strip()


def all_files(manager: CgroupV1Manager, layout) -> dict[str, str]:
    out = {}
    for controller, name in [("cpu", "cpu.cfs_quota_us"), ("cpu", "cpu.cfs_period_us"),
                             ("cpu", "cpu.shares"), ("memory", "memory.limit_in_bytes"),
                             ("pids", "pids.max"), ("cpuset", "cpuset.cpus"),
                             ("devices", "devices.list")]:
        out[name] = read(manager, controller, layout.sandbox, name)
    for child in ("vcpus", "vmm"):
        out[f"{child}/cpuset.cpus"] = read(manager, "cpuset", f"{layout.sandbox}/{child}",
                                           "cpuset.cpus")
    return out


def host_cpus(manager: CgroupV1Manager) -> str:
    return read(manager, "cpuset", "/", "cpuset.cpus")


def test_limits_appear_in_the_files(v1_manager, layout):
    sandbox = SandboxCgroup.create(layout, LIMITS, manager=v1_manager)
    files = all_files(v1_manager, layout)
    assert files["cpu.cfs_quota_us"] == "50000"
    assert files["cpu.cfs_period_us"] == "50000"
    assert files["cpu.shares"] == "512"
    assert files["memory.limit_in_bytes"] == str(256 << 20)
    assert files["pids.max"] == "64"
    assert sorted(files["devices.list"].splitlines()) == sorted(r.line for r in QEMU_DEVICES)
    limits = sandbox.read_back().limits
    assert (limits.cpu_quota_us, limits.cpu_period_us, limits.cpu_shares,
            limits.memory_limit_bytes, limits.pids_limit) == (50_000, 50_000, 512, 256 << 20, 64)


def test_none_leaves_every_dimension_unlimited(v1_manager, layout):
    sandbox = SandboxCgroup.create(layout, LIMITS, manager=v1_manager)
    sandbox.apply(CgroupLimits())
    files = all_files(v1_manager, layout)
    assert files["cpu.cfs_quota_us"] == "-1"
    assert files["cpu.cfs_period_us"] == "100000"
    assert files["cpu.shares"] == "1024"
    assert int(files["memory.limit_in_bytes"]) > 1 << 62
    assert files["pids.max"] == "max"
    assert files["devices.list"] == "a *:* rwm"
    limits = sandbox.read_back().limits
    assert (limits.cpu_quota_us, limits.memory_limit_bytes, limits.pids_limit) == \
        (None, None, None)


def test_a_missing_pod_cgroup_is_created_with_its_parents_and_cpusets(v1_manager, layout):
    SandboxCgroup.create(layout, manager=v1_manager)
    levels = layout.ancestors()[:-1]
    for h in v1_manager.hierarchies:
        for path in levels + [layout.sandbox]:
            assert os.path.isdir(os.path.join(h.mountpoint, path.lstrip("/"))), (h, path)
    for path in levels + [layout.sandbox, layout.vcpus, layout.vmm]:
        assert read(v1_manager, "cpuset", path, "cpuset.cpus") == host_cpus(v1_manager)
        assert read(v1_manager, "cpuset", path, "cpuset.mems") == \
            read(v1_manager, "cpuset", "/", "cpuset.mems")
    for controller in ("memory", "pids", "devices"):
        (h,) = [h for h in v1_manager.hierarchies if controller in h.controllers]
        assert not os.path.exists(os.path.join(h.mountpoint, layout.vcpus.lstrip("/")))


def test_children_take_the_pod_cpuset_and_follow_every_change(v1_manager, layout):
    cpus = sorted(int(c) for c in _expand(host_cpus(v1_manager)))
    require(len(cpus) >= 2, "two CPUs (to move a cpuset between disjoint sets)")
    first, second = str(cpus[0]), str(cpus[1])
    # kubelet made the pod cgroup with its own cpuset: the sandbox starts from it.
    (h,) = [h for h in v1_manager.hierarchies if "cpuset" in h.controllers]
    for path in reversed(layout.ancestors()[:-1]):
        directory = os.path.join(h.mountpoint, path.lstrip("/"))
        os.mkdir(directory)
        for name in ("cpuset.mems", "cpuset.cpus"):
            value = read(v1_manager, "cpuset", os.path.dirname(path) or "/", name)
            with open(os.path.join(directory, name), "w") as f:
                f.write(second if name == "cpuset.cpus" and path == layout.pod_cgroup else value)
    sandbox = SandboxCgroup.create(layout, manager=v1_manager)
    for child in ("vcpus", "vmm"):
        assert all_files(v1_manager, layout)[f"{child}/cpuset.cpus"] == second
    with pytest.raises(InvalidLimits, match="cpuset.cpus"):
        sandbox.apply(CgroupLimits(cpuset_cpus=first))
    assert all_files(v1_manager, layout)["cpuset.cpus"] == second

    with open(os.path.join(h.mountpoint, layout.pod_cgroup.lstrip("/"), "cpuset.cpus"),
              "w") as f:
        f.write(f"{first},{second}")
    for wanted in (first, second, f"{first},{second}", second):
        sandbox.apply(CgroupLimits(cpuset_cpus=wanted))  # disjoint moves included
        files = all_files(v1_manager, layout)
        canonical = CgroupLimits(cpuset_cpus=wanted).cpuset_cpus
        assert files["cpuset.cpus"] == files["vcpus/cpuset.cpus"] == \
            files["vmm/cpuset.cpus"] == canonical
    # An overhead CPU set: vmm/ on its own CPUs, the sandbox holds both sets.
    sandbox.apply(CgroupLimits(cpuset_cpus=second, vmm_cpuset_cpus=first))
    files = all_files(v1_manager, layout)
    assert (files["vcpus/cpuset.cpus"], files["vmm/cpuset.cpus"]) == (second, first)
    assert files["cpuset.cpus"] == CgroupLimits(cpuset_cpus=f"{first},{second}").cpuset_cpus
    sandbox.apply(CgroupLimits(cpuset_cpus=second))
    assert all_files(v1_manager, layout)["vmm/cpuset.cpus"] == second


def test_apply_refused_by_the_kernel_puts_every_old_value_back(v1_manager, layout,
                                                               start_qemu):
    sandbox = SandboxCgroup.create(layout, LIMITS, manager=v1_manager)
    start_qemu(sandbox)  # tens of MiB charged: a 1 MiB limit cannot be met
    before = all_files(v1_manager, layout)
    bad = CgroupLimits(cpu_quota_us=20_000, cpu_period_us=100_000, cpu_shares=100,
                       memory_limit_bytes=1 << 20, pids_limit=5)
    with pytest.raises(CgroupIOError, match="memory.limit_in_bytes.*EBUSY"):
        sandbox.apply(bad)
    assert all_files(v1_manager, layout) == before


def test_a_limit_for_a_controller_the_host_lacks_is_refused_before_any_write(v1_manager,
                                                                            layout):
    without_pids = CgroupV1Manager(h for h in v1_manager.hierarchies
                                   if "pids" not in h.controllers)
    assert "pids" not in without_pids.controllers
    with pytest.raises(ControllerUnavailable, match="pids") as err:
        SandboxCgroup.create(layout, CgroupLimits(cpu_quota_us=10_000, pids_limit=10),
                             manager=without_pids)
    assert err.value.controllers == ("pids",)
    assert not without_pids.exists(layout)
    sandbox = SandboxCgroup.create(layout, manager=without_pids)
    with pytest.raises(ControllerUnavailable):
        sandbox.apply(CgroupLimits(cpu_quota_us=10_000, pids_limit=10))
    assert read(v1_manager, "cpu", layout.sandbox, "cpu.cfs_quota_us") == "-1"
    sandbox.apply(CgroupLimits(cpu_quota_us=10_000, pids_limit=10)
                  .restricted_to(without_pids.controllers))
    assert read(v1_manager, "cpu", layout.sandbox, "cpu.cfs_quota_us") == "10000"


def test_the_device_allow_list_lets_qemu_devices_through_and_nothing_else(v1_manager, layout,
                                                                          processes):
    require(os.path.exists("/dev/kmsg"), "/dev/kmsg (a device outside the allow-list)")
    sandbox = SandboxCgroup.create(layout, CgroupLimits(devices=QEMU_DEVICES),
                                   manager=v1_manager)
    probe = ("import sys\nfor p in sys.argv[1:]:\n    try:\n        open(p, 'rb').close()\n"
             "        print(p, 'ok')\n    except OSError as e:\n        print(p, e.errno)\n")

    def opens() -> dict[str, str]:
        proc = processes.add(sandbox.spawn(
            [sys.executable, "-c", probe, "/dev/null", "/dev/urandom", "/dev/kmsg"],
            stdout=subprocess.PIPE, text=True))
        out, _ = proc.communicate(timeout=30)
        return dict(line.split() for line in out.splitlines())

    assert opens() == {"/dev/null": "ok", "/dev/urandom": "ok", "/dev/kmsg": "1"}  # EPERM
    sandbox.apply(CgroupLimits())
    assert opens()["/dev/kmsg"] == "ok"


def test_qemu_started_inside_is_charged_from_its_first_page(v1_manager, layout, start_qemu):
    sandbox = SandboxCgroup.create(layout, manager=v1_manager)
    qemu = start_qemu(sandbox)
    with open(f"/proc/{qemu.pid}/status") as f:
        rss_anon = next(int(line.split()[1]) * 1024 for line in f
                        if line.startswith("RssAnon:"))
    usage = int(read(v1_manager, "memory", layout.sandbox, "memory.usage_in_bytes"))
    assert rss_anon > 1 << 20
    assert usage >= rss_anon


def _expand(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out
