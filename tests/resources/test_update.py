"""Re-planning a running pod: totals from every container, the step from one plan to the
next, static and dynamic mode; examples and properties over pod shapes."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shim.resources import (ContainerResources, Host, NoFit, PlanError, StaticSizeExceeded,
                            plan_sandbox, plan_update, pod_totals)

from .test_model import HOST, MIB, request

OVERHEAD = 192


def plan_for(pod: ContainerResources, **kw):
    kw.setdefault("memory_overhead_mib", OVERHEAD)
    kw.setdefault("max_vcpus", 8)
    kw.setdefault("max_memory_mib", 8192)
    return plan_sandbox(request(pod, **kw), HOST)


def cpus(n: float, memory_mib: int = 0, cpuset: str = "") -> ContainerResources:
    return ContainerResources(cpu_quota=int(n * 100_000) if n else 0,
                              cpu_period=100_000 if n else 0,
                              memory_limit=memory_mib * MIB, cpuset=cpuset)


def test_totals_are_the_larger_of_the_sandbox_and_the_sum_of_containers() -> None:
    sandbox = cpus(2, 512)
    assert pod_totals(sandbox, {}).quota_cpus == 2
    within = pod_totals(sandbox, {"a": cpus(1, 256), "b": cpus(0.5, 128)})
    assert (within.quota_cpus, within.memory_limit) == (2, 512 * MIB)
    beyond = pod_totals(sandbox, {"a": cpus(1.5, 400), "b": cpus(1, 200)})
    assert (beyond.quota_cpus, beyond.memory_limit) == (2.5, 600 * MIB)
    assert pod_totals(ContainerResources(), {"a": cpus(0, cpuset="0-1"),
                                             "b": cpus(0, cpuset="3,1")}).cpuset == "0-1,3"
    assert pod_totals(ContainerResources(), {"a": cpus(1)}).cpuset == ""


def test_dynamic_grow_hot_plugs_cpus_and_whole_memory_blocks() -> None:
    boot = plan_for(ContainerResources())
    wanted = plan_for(cpus(1, 200))
    delta = plan_update(boot, boot, wanted, static=False)
    assert (delta.add_vcpus, delta.add_memory_mib, delta.remove_vcpus) == (1, 256, 0)
    assert delta.plan.memory_mib == 512  # 456 wanted, in 128 MiB blocks
    assert delta.plan.cgroup_memory_limit == (512 + OVERHEAD) * MIB
    assert delta.grows and any("hot-plugged" in n for n in delta.notes)


def test_dynamic_shrink_unplugs_hot_added_cpus_and_keeps_memory() -> None:
    boot = plan_for(ContainerResources())
    grown = plan_update(boot, boot, plan_for(cpus(2, 300)), static=False).plan
    delta = plan_update(grown, boot, plan_for(ContainerResources()), static=False)
    assert (delta.remove_vcpus, delta.add_memory_mib) == (2, 0)
    assert delta.plan.vcpus == boot.vcpus and delta.plan.memory_mib == grown.memory_mib
    assert any("never taken back" in n for n in delta.notes) and not delta.grows


def test_static_refuses_growth_with_numbers_and_applies_what_fits() -> None:
    boot = plan_for(cpus(2.5, 512))
    assert (boot.vcpus, boot.memory_mib) == (4, 768)
    with pytest.raises(StaticSizeExceeded, match=r"5 vCPUs \(the VM has 4\)"):
        plan_update(boot, boot, plan_for(cpus(4, 512)), static=True)
    with pytest.raises(StaticSizeExceeded, match=r"1280 MiB \(the VM has 768 MiB\)"):
        plan_update(boot, boot, plan_for(cpus(2.5, 1024)), static=True)
    smaller = plan_update(boot, boot, plan_for(cpus(1, 256)), static=True)
    assert (smaller.add_vcpus, smaller.remove_vcpus, smaller.add_memory_mib) == (0, 0, 0)
    assert (smaller.plan.vcpus, smaller.plan.memory_mib) == (4, 768)
    assert smaller.plan.cgroup_cpu_quota == 200_000  # 1 CPU + the guest's own
    assert smaller.plan.cgroup_memory_limit >= (768 + OVERHEAD) * MIB


def test_static_refusal_carries_what_fits() -> None:
    boot = plan_for(cpus(2.5, 512, cpuset="0-3"))
    with pytest.raises(StaticSizeExceeded) as err:
        plan_update(boot, boot, plan_for(cpus(6, 1024, cpuset="0-5")), static=True)
    fit = err.value.fitting
    assert fit is not None and not fit.grows and fit.remove_vcpus == 0
    assert (fit.plan.vcpus, fit.plan.memory_mib) == (4, 768)
    assert fit.plan.cgroup_cpu_quota == 400_000  # what 4 vCPUs can use, not 7 CPUs
    assert fit.plan.cgroup_memory_limit == (768 + OVERHEAD) * MIB
    assert fit.plan.cpuset == "0-5" and "what fits in it: CPU quota 400000/100000" in fit.notes[0]
    assert fit.plan.explanation[-1] == fit.notes[0]


def test_memory_growth_beyond_the_maximum_is_refused() -> None:
    boot = plan_for(ContainerResources(), max_memory_mib=512)
    wanted = plan_for(cpus(0, 300), max_memory_mib=1024)  # 556 MiB: 640 in blocks
    with pytest.raises(NoFit, match="556 MiB.*that is 640 MiB, more than the VM may grow "
                                    "to \\(512 MiB\\)"):
        plan_update(boot, boot, wanted, static=False)


def test_memory_blocks_must_fit_the_pod_cgroup() -> None:
    boot = plan_for(ContainerResources())
    # 200 MiB of workload fits the pod cgroup, the 256 MiB in blocks do not
    wanted = plan_for(cpus(0, 200), pod_cgroup_memory_mib=256 + 200 + OVERHEAD)
    with pytest.raises(NoFit, match=f"512 MiB \\+ {OVERHEAD} MiB QEMU overhead = "
                                    f"{512 + OVERHEAD} MiB, but its pod cgroup allows "
                                    f"{456 + OVERHEAD} MiB: declare 127 MiB more"):
        plan_update(boot, boot, wanted, static=False)
    roomy = plan_for(cpus(0, 200), pod_cgroup_memory_mib=512 + OVERHEAD)
    assert plan_update(boot, boot, roomy, static=False).plan.memory_mib == 512


def test_every_change_is_explained() -> None:
    boot = plan_for(ContainerResources())
    grown = plan_update(boot, boot, plan_for(cpus(2, 200)), static=False)
    text = " ".join(grown.plan.explanation)
    assert "vCPUs 1 -> 3: 2 hot-plugged" in text
    assert "memory 256 -> 512 MiB (256 MiB hot-plugged as 2 128 MiB blocks" in text
    assert f"sandbox cgroup memory {512 + OVERHEAD} MiB = VM 512 MiB" in text
    shrunk = plan_update(grown.plan, boot, plan_for(ContainerResources()), static=False)
    assert "2 hot-added removed (the 1 boot vCPUs stay)" in " ".join(shrunk.notes)


def test_pod_cgroup_limit_is_checked_before_boot() -> None:
    with pytest.raises(NoFit, match="pod cgroup allows 600 MiB.*overhead.podFixed.memory"):
        plan_for(cpus(1, 256), pod_cgroup_memory_mib=600)
    assert plan_for(cpus(1, 256), pod_cgroup_memory_mib=256 + 256 + OVERHEAD).vcpus == 2
    with pytest.raises(NoFit, match="pod cgroup allows 1.5.*overhead.podFixed.cpu"):
        plan_for(cpus(1), pod_cgroup_cpus=1.5)


container_shapes = st.builds(
    ContainerResources,
    cpu_quota=st.one_of(st.just(0), st.just(-1), st.integers(1_000, 300_000)),
    cpu_period=st.one_of(st.just(0), st.just(100_000), st.integers(1_000, 1_000_000)),
    cpu_shares=st.one_of(st.just(0), st.integers(2, 4096)),
    memory_limit=st.one_of(st.just(0), st.integers(1, 2048).map(lambda m: m * MIB)),
    cpuset=st.sampled_from(["", "0", "1", "0-1", "2-3"]))


@settings(deadline=None)
@given(sandbox=container_shapes,
       steps=st.lists(st.dictionaries(st.sampled_from("abc"), container_shapes, max_size=3),
                      min_size=1, max_size=4),
       static=st.booleans())
def test_properties_through_a_pod_s_life(sandbox, steps, static) -> None:
    host = Host(cpus=16, memory_mib=64 * 1024)
    kw = dict(memory_overhead_mib=OVERHEAD, max_vcpus=12, max_memory_mib=16 * 1024)
    try:
        boot = plan_sandbox(request(pod_totals(sandbox, {}), **kw), host)
    except PlanError:
        return
    current = boot
    for containers in steps:
        pod = pod_totals(sandbox, containers)
        try:
            delta = plan_update(current, boot, plan_sandbox(request(pod, **kw), host), static)
        except PlanError:
            continue  # refused: the plan in force stays
        plan = delta.plan
        if static:
            assert (plan.vcpus, plan.memory_mib) == (boot.vcpus, boot.memory_mib)
        else:
            assert plan.vcpus >= math.ceil(pod.quota_cpus) and plan.vcpus >= boot.vcpus
            assert plan.memory_mib >= current.memory_mib  # never taken back
            assert (plan.memory_mib - boot.memory_mib) % 128 == 0
        assert plan.vcpus <= plan.max_vcpus and plan.memory_mib <= plan.max_memory_mib
        if plan.cgroup_memory_limit != -1:
            assert plan.cgroup_memory_limit >= (plan.memory_mib + OVERHEAD) * MIB
        if plan.cgroup_cpu_quota != -1:
            assert plan.cgroup_cpu_quota / plan.cgroup_cpu_period >= pod.quota_cpus
        assert delta.add_vcpus - delta.remove_vcpus == plan.vcpus - current.vcpus
        assert delta.add_memory_mib == plan.memory_mib - current.memory_mib
        current = plan
