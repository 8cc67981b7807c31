"""Re-planning a running pod: totals from every container, the step from one plan to the
next, static and dynamic mode; examples and properties over pod shapes."""
from __future__ import annotations

import math
import sys

import pytest
from hypothesis import given, settings

from shim.resources import (ContainerResources, Host, NoFit, SandboxPlan, SandboxRequest,
                            StaticSizeExceeded, plan_sandbox, plan_update, pod_totals)

from .oracle import (assert_admission_expected, assert_refusal_expected, expected_plan,
                     expected_update)
from .picks import Pick, assert_fails, either, sample, strategy
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


@pytest.mark.parametrize("static", [False, True])
def test_an_update_beyond_the_vcpu_cap_gets_the_cap_and_the_quota_it_asked(static) -> None:
    """Booted at the cap (1.5 CPUs + the guest's vCPU on a VM of at most 2), then asking
    for 3.5 CPUs: applied in both modes, with 2 vCPUs and a quota of 3.5 + 1 CPUs."""
    boot = plan_for(cpus(1.5), max_vcpus=2)
    assert (boot.vcpus, boot.uncapped_vcpus) == (2, 3)
    delta = plan_update(boot, boot, plan_for(cpus(3.5), max_vcpus=2), static=static)
    assert (delta.add_vcpus, delta.remove_vcpus, delta.plan.vcpus) == (0, 0, 2)
    assert delta.plan.uncapped_vcpus == 5
    assert (delta.plan.cgroup_cpu_quota, delta.plan.cgroup_cpu_period) == (450_000, 100_000)
    assert "vCPUs capped at 2 (default_maxvcpus) instead of 5" in \
        " ".join(delta.plan.explanation)


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


def test_a_pod_cgroup_of_the_limits_plus_the_overhead_admits_the_pod() -> None:
    """kubelet's pod cgroup quota is the containers' limits plus the declared overhead,
    to the µs: the sandbox's quota must not come to a µs more (100m + 200m summed as
    floats is 0.30000000000000004 CPUs; (0.039 + 2) x 100000 is 203900.00000000003)."""
    def millis(m: int) -> ContainerResources:
        return ContainerResources(cpu_quota=m * 100, cpu_period=100_000)

    pod = pod_totals(millis(300), {"a": millis(100), "b": millis(200)})
    assert (pod.cpu_quota, pod.cpu_period) == (30_000, 100_000)
    assert plan_for(pod, pod_cgroup_cpus=1.3).cgroup_cpu_quota == 130_000
    plan = plan_for(millis(39), default_vcpus=2, pod_cgroup_cpus=2.039)
    assert (plan.cgroup_cpu_quota, plan.cgroup_cpu_period) == (203_900, 100_000)


def memory_growth(pick: Pick) -> tuple[int, int, int, int]:
    """(boot MiB, maximum MiB, workload MiB, pod cgroup MiB or 0): a workload the maximum
    holds, near enough to it (or to the pod cgroup) that whole blocks may not fit."""
    boot = pick.integer(128, 2048)
    maximum = boot + pick.integer(1, 1024)
    workload = pick.integer(max(1, maximum - boot - 300), maximum - boot)
    pod_cgroup = pick.choice([0, boot + workload + OVERHEAD + pick.integer(0, 127)])
    return boot, maximum, workload, pod_cgroup


def grow(boot_mib: int, max_mib: int, workload_mib: int, pod_cgroup_mib: int) -> bool:
    """Hot-plug `workload_mib` into a VM booted with `boot_mib`: applied or refused
    exactly as the rules say (refused when the whole blocks pass the maximum or the pod
    cgroup), the refusal naming the reason; whether it was applied."""
    boot = plan_for(ContainerResources(), default_memory_mib=boot_mib, max_memory_mib=max_mib)
    req = request(cpus(0, workload_mib), default_vcpus=1, default_memory_mib=boot_mib,
                  max_vcpus=8, max_memory_mib=max_mib, memory_overhead_mib=OVERHEAD,
                  pod_cgroup_memory_mib=pod_cgroup_mib)
    expected = expected_plan(req, HOST)
    assert_admission_expected(expected.reasons)  # the generator's promise
    wanted = plan_sandbox(req, HOST)
    reasons = expected_update(boot, boot, expected, False, OVERHEAD, pod_cgroup_mib)
    try:
        delta = plan_update(boot, boot, wanted, static=False)
    except NoFit as exc:
        assert_refusal_expected(str(exc), reasons)
        return False
    assert_admission_expected(reasons)
    assert delta.add_memory_mib % 128 == 0 and delta.plan.memory_mib >= boot_mib + workload_mib
    assert delta.plan.memory_mib <= max_mib
    return True


@settings(max_examples=200, deadline=None, derandomize=True)
@given(growth=strategy(memory_growth))
def test_memory_blocks_are_refused_exactly_when_they_do_not_fit(growth) -> None:
    """See `grow`; both outcomes come up: the test below."""
    grow(*growth)


def test_memory_growth_near_the_limits_is_both_applied_and_refused() -> None:
    """The space above is drawn at the limits on purpose, so refusals are common there;
    a fixed sample shows it exercises both outcomes, so neither way passes vacuously."""
    outcomes = [grow(*growth) for growth in sample(memory_growth)]
    assert 0 < outcomes.count(False) < len(outcomes) and 0 < outcomes.count(True), outcomes


def container_shape(pick: Pick) -> ContainerResources:
    """A container's (or the sandbox's) resources, CFS quota disabled (-1, 0/0) included:
    up to 300 CPUs at the shortest period, so some do not fit."""
    return ContainerResources(cpu_quota=either(pick, (0, -1), 1_000, 300_000),
                              cpu_period=either(pick, (0, 100_000), 1_000, 1_000_000),
                              cpu_shares=either(pick, (0,), 2, 4096),
                              memory_limit=either(pick, (0,), 1, 2048) * MIB,
                              cpuset=pick.choice(["", "0", "1", "0-1", "2-3"]))


def containers(pick: Pick) -> dict[str, ContainerResources]:
    return {name: container_shape(pick) for name in "abc"[:pick.integer(0, 3)]}


def life(pick: Pick) -> tuple[ContainerResources, list[dict[str, ContainerResources]], bool]:
    """A sandbox, then the pod's containers step by step, in static or dynamic mode."""
    return (container_shape(pick), [containers(pick) for _ in range(pick.integer(1, 4))],
            pick.choice([False, True]))


LIFE_HOST = Host(cpus=16, memory_mib=64 * 1024)
LIFE_CONFIG = dict(memory_overhead_mib=OVERHEAD, max_vcpus=12, max_memory_mib=16 * 1024)


def steps_of_a_life(sandbox: ContainerResources, steps: list[dict[str, ContainerResources]],
                    static: bool) -> tuple[int, int]:
    """Boot, then each step, each admitted or refused exactly as the rules say (the
    refusal naming the reason); a refused step leaves the plan in force, an applied one
    keeps the promises. (steps applied, boot and steps refused)."""
    req = request(pod_totals(sandbox, {}), **LIFE_CONFIG)
    expected = expected_plan(req, LIFE_HOST)
    try:
        boot = plan_sandbox(req, LIFE_HOST)
    except NoFit as exc:
        assert_refusal_expected(str(exc), expected.reasons)
        return 0, 1  # no pod: nothing more happens in its life
    assert_admission_expected(expected.reasons)
    current, applied, refused = boot, 0, 0
    for step in steps:
        pod = pod_totals(sandbox, step)
        req = request(pod, **LIFE_CONFIG)
        expected = expected_plan(req, LIFE_HOST)
        try:
            wanted = plan_sandbox(req, LIFE_HOST)
        except NoFit as exc:
            assert_refusal_expected(str(exc), expected.reasons)
            refused += 1
            continue  # refused: the plan in force stays
        assert_admission_expected(expected.reasons)
        reasons = expected_update(current, boot, expected, static, OVERHEAD)
        try:
            delta = plan_update(current, boot, wanted, static)
        except (StaticSizeExceeded, NoFit) as exc:
            assert isinstance(exc, StaticSizeExceeded) == static, exc
            assert_refusal_expected(str(exc), reasons)
            refused += 1
            continue
        assert_admission_expected(reasons)
        applied += 1
        plan = delta.plan
        if static:
            assert (plan.vcpus, plan.memory_mib) == (boot.vcpus, boot.memory_mib)
        else:
            assert plan.vcpus >= min(math.ceil(pod.quota_cpus), plan.max_vcpus)
            assert plan.vcpus >= boot.vcpus
            assert plan.vcpus == max(boot.vcpus, expected.vcpus)
            assert plan.memory_mib >= max(current.memory_mib, expected.memory_mib)
            assert (plan.memory_mib - boot.memory_mib) % 128 == 0
        assert plan.vcpus <= plan.max_vcpus and plan.memory_mib <= plan.max_memory_mib
        if plan.cgroup_memory_limit != -1:
            assert plan.cgroup_memory_limit >= (plan.memory_mib + OVERHEAD) * MIB
        if plan.cgroup_cpu_quota != -1:
            assert plan.cgroup_cpu_quota / plan.cgroup_cpu_period >= pod.quota_cpus
        assert delta.add_vcpus - delta.remove_vcpus == plan.vcpus - current.vcpus
        assert delta.add_memory_mib == plan.memory_mib - current.memory_mib
        current = plan
    return applied, refused


@settings(max_examples=200, deadline=None, derandomize=True)
@given(life=strategy(life))
def test_properties_through_a_pod_s_life(life) -> None:
    """See `steps_of_a_life`; how often steps are refused: the test below."""
    steps_of_a_life(*life)


def test_most_steps_are_applied() -> None:
    """The guard against passing vacuously: over a fixed sample of the lives above, each
    boot and step checked against the rules, a dynamic VM applies most steps; a static
    one refuses every growth beyond its boot size, which containers drawn apart from the
    sandbox often ask for, yet still applies a good share. A model that refused
    everything fails here."""
    counts = {False: [0, 0], True: [0, 0]}  # static: [applied, refused]
    for sandbox, steps, static in sample(life):
        applied, refused = steps_of_a_life(sandbox, steps, static)
        counts[static][0] += applied
        counts[static][1] += refused
    (dynamic_applied, dynamic_refused), (static_applied, static_refused) = \
        counts[False], counts[True]
    assert dynamic_refused < dynamic_applied // 10, counts
    assert static_refused > 0 and static_applied > (static_applied + static_refused) // 3, \
        counts


def test_the_properties_fail_for_a_model_that_refuses_everything(monkeypatch) -> None:
    """The properties above assert plans, not just the absence of errors."""
    def refuse(req: SandboxRequest, host: Host) -> SandboxPlan:
        raise NoFit("the pod needs 1 MiB of VM memory but at most 0 MiB are allowed (host memory)")

    monkeypatch.setattr(sys.modules[__name__], "plan_sandbox", refuse)
    for prop in (test_memory_blocks_are_refused_exactly_when_they_do_not_fit,
                 test_properties_through_a_pod_s_life):
        assert_fails(prop, NoFit, AssertionError)
