"""cgroup v2: the sandbox is a domain holding the process, vcpus/ and vmm/ are threaded
children that threads enter one by one. Runs on this host's cgroup2 mount (a hybrid host's
unified hierarchy has no cpu/memory/pids/cpuset: limits for those must be refused
clearly there, and written where the controller exists)."""
from __future__ import annotations

import os

import pytest

from cgroups import QEMU_DEVICES, CgroupLimits, ControllerUnavailable, SandboxCgroup
from tests.cgroups.conftest import threads_of


def directory(manager, path: str) -> str:
    return os.path.join(manager.hierarchy.mountpoint, path.lstrip("/"))


def read(manager, path: str, name: str) -> str:
    with open(os.path.join(directory(manager, path), name)) as f:
        return f.read().strip()


def ids(manager, path: str, name: str) -> list[int]:
    return sorted(int(x) for x in read(manager, path, name).split())


def root_controllers(manager) -> set[str]:
    return set(read(manager, "/", "cgroup.controllers").split())


def test_sandbox_is_a_domain_and_its_children_are_threaded(v2_manager, layout):
    SandboxCgroup.create(layout, manager=v2_manager)
    assert read(v2_manager, layout.sandbox, "cgroup.type") == "domain threaded"
    assert read(v2_manager, layout.vcpus, "cgroup.type") == "threaded"
    assert read(v2_manager, layout.vmm, "cgroup.type") == "threaded"
    threaded = {"cpu", "cpuset"} & root_controllers(v2_manager)
    assert set(read(v2_manager, layout.sandbox, "cgroup.subtree_control").split()) == threaded
    domain = {"cpu", "cpuset", "memory", "pids", "io"} & root_controllers(v2_manager)
    assert set(read(v2_manager, layout.sandbox, "cgroup.controllers").split()) == domain
    for path in layout.ancestors()[:-1]:
        assert os.path.isdir(directory(v2_manager, path))


def test_process_in_cgroup_procs_threads_in_cgroup_threads(v2_manager, layout, start_helper):
    sandbox = SandboxCgroup.create(layout, manager=v2_manager)
    helper = start_helper(sandbox, threads=3)
    assert ids(v2_manager, layout.sandbox, "cgroup.procs") == [helper.pid]
    assert ids(v2_manager, layout.sandbox, "cgroup.threads") == threads_of(helper.pid)

    vcpu, *others = helper.workers
    sandbox.place_threads({"vcpu": [vcpu], "main": [helper.pid], "worker": others})
    assert ids(v2_manager, layout.vcpus, "cgroup.threads") == [vcpu]
    assert ids(v2_manager, layout.vmm, "cgroup.threads") == sorted([helper.pid] + others)
    assert ids(v2_manager, layout.sandbox, "cgroup.threads") == []
    # The process still belongs to the domain: memory and pids are charged there.
    assert ids(v2_manager, layout.sandbox, "cgroup.procs") == [helper.pid]


CASES = {
    "cpu": (CgroupLimits(cpu_quota_us=50_000, cpu_period_us=100_000, cpu_shares=512),
            {"cpu.max": "50000 100000", "cpu.weight": "20"}),
    "memory": (CgroupLimits(memory_limit_bytes=256 << 20), {"memory.max": str(256 << 20)}),
    "pids": (CgroupLimits(pids_limit=64), {"pids.max": "64"}),
    "cpuset": (CgroupLimits(cpuset_cpus="0", cpuset_mems="0"),
               {"cpuset.cpus": "0", "cpuset.mems": "0"}),
}


@pytest.mark.parametrize("controller", sorted(CASES))
def test_limits_are_written_where_the_controller_exists_and_refused_where_not(
        v2_manager, layout, controller):
    limits, files = CASES[controller]
    sandbox = SandboxCgroup.create(layout, manager=v2_manager)
    available = controller in root_controllers(v2_manager)
    assert (controller in v2_manager.controllers) == available
    if available:
        sandbox.apply(limits)
        for name, value in files.items():
            assert read(v2_manager, layout.sandbox, name) == value
        if controller == "cpuset":
            for child in (layout.vcpus, layout.vmm):
                assert read(v2_manager, child, "cpuset.cpus") == "0"
        sandbox.apply(CgroupLimits())
        reset = {"cpu.max": "max 100000", "cpu.weight": "100", "memory.max": "max",
                 "pids.max": "max",
                 "cpuset.cpus": read(v2_manager, layout.pod_cgroup, "cpuset.cpus.effective"),
                 "cpuset.mems": read(v2_manager, layout.pod_cgroup, "cpuset.mems.effective")}
        for name in files:
            assert read(v2_manager, layout.sandbox, name) == reset[name]
    else:
        with pytest.raises(ControllerUnavailable, match=controller) as err:
            sandbox.apply(limits)
        assert err.value.controllers == (controller,)
        for name in files:
            assert not os.path.exists(os.path.join(directory(v2_manager, layout.sandbox), name))
        sandbox.apply(limits.restricted_to(v2_manager.controllers))


def test_the_device_allow_list_is_v1_only(v2_manager, layout):
    assert "devices" not in v2_manager.controllers
    with pytest.raises(ControllerUnavailable, match="devices"):
        SandboxCgroup.create(layout, CgroupLimits(devices=QEMU_DEVICES), manager=v2_manager)
    assert not v2_manager.exists(layout)
