"""The model's promises over pod shapes Kubernetes produces (limits only, requests and
limits, requests only, none, several containers, cpusets, CFS quota disabled), through a
pod's life: boot from the sandbox annotations, containers created and updated, in static
and dynamic mode."""
from __future__ import annotations

import math
import re
import sys
from dataclasses import dataclass, replace

from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from cgroups.limits import parse_cpu_list
from shim.resources import (ContainerResources, Host, NoFit, SandboxPlan, SandboxRequest,
                            StaticSizeExceeded, plan_sandbox, plan_update, pod_totals)

from .oracle import (assert_admission_expected, assert_refusal_expected, expected_plan,
                     expected_update)
from .picks import Pick, assert_fails, sample, strategy

MIB = 1 << 20
HOST = Host(cpus=16, memory_mib=64 * 1024)
PERIOD = 100_000
KINDS = ["limits", "requests+limits", "requests", "none", "quota-disabled"]


def container(pick: Pick) -> ContainerResources:
    kind = pick.choice(KINDS)
    limit = pick.integer(1, 40) / 10  # CPUs
    request = min(limit, pick.integer(1, 40) / 10)
    memory = pick.integer(1, 1024) * MIB
    cpuset = pick.choice(["", "0", "1-2", "3", "0-3", "8-11,14"])
    if kind == "limits":  # request defaults to the limit
        return ContainerResources(int(limit * PERIOD), PERIOD, int(limit * 1024), memory,
                                  cpuset)
    if kind == "requests+limits":
        return ContainerResources(int(limit * PERIOD), PERIOD, int(request * 1024), memory,
                                  cpuset)
    if kind == "requests":
        return ContainerResources(0, 0, int(request * 1024), 0, cpuset)
    if kind == "none":
        return ContainerResources(0, 0, 2, 0, "")
    # the static CPU manager, or kubelet's --cpu-cfs-quota=false
    quota, period = pick.choice([(-1, PERIOD), (0, 0)])
    return ContainerResources(quota, period, int(limit * 1024), memory, cpuset)


def pod(pick: Pick) -> dict[str, ContainerResources]:
    """Up to four containers."""
    return {name: container(pick) for name in "abcd"[:pick.integer(0, 4)]}


def annotations_of(containers: dict[str, ContainerResources]) -> ContainerResources:
    """What containerd's CRI puts on the sandbox: the pod's totals."""
    quota_cpus = sum(c.quota_cpus for c in containers.values())
    return ContainerResources(cpu_quota=math.ceil(quota_cpus * PERIOD) if quota_cpus else 0,
                              cpu_period=PERIOD if quota_cpus else 0,
                              cpu_shares=sum(c.cpu_shares for c in containers.values()),
                              memory_limit=sum(c.memory_limit for c in containers.values()))


pods = strategy(pod)
settings_ = dict(max_examples=300, deadline=None, derandomize=True)


def request(pod: ContainerResources, kw: dict) -> SandboxRequest:
    return SandboxRequest(pod=pod, **kw)


def config(pick: Pick) -> dict:
    """Maxima below what four containers may ask for: some pods are capped (vCPUs), some
    do not fit (memory)."""
    return {"default_vcpus": pick.integer(1, 3),
            "default_memory_mib": pick.choice([128, 256, 2048]),
            "max_vcpus": pick.choice([0, 8, 12]),
            "max_memory_mib": pick.choice([0, 2048, 4096, 8192]),
            "sizing": pick.choice(["sum", "max"]), "memory_overhead_mib": pick.choice([0, 256])}


configs = strategy(config)


def check_plan(plan: SandboxPlan, pod: ContainerResources, kw: dict) -> None:
    """What every plan in force promises."""
    assert plan.vcpus >= min(math.ceil(pod.quota_cpus - 1e-9), plan.max_vcpus)
    assert plan.vcpus >= 1
    assert plan.vcpus <= plan.max_vcpus and plan.memory_mib <= plan.max_memory_mib
    assert plan.memory_mib >= math.ceil(pod.memory_limit / MIB)
    if plan.cgroup_memory_limit != -1:  # -1: the pod has no memory limit at all
        assert plan.cgroup_memory_limit >= (plan.memory_mib + kw["memory_overhead_mib"]) * MIB
    else:
        assert pod.memory_limit == 0
    if plan.cgroup_cpu_quota != -1:
        assert plan.cgroup_cpu_quota / plan.cgroup_cpu_period >= pod.quota_cpus
    assert plan.cgroup_cpu_shares >= 2


def boot_totals(containers: dict[str, ContainerResources],
                annotated: bool) -> ContainerResources:
    """The pod's totals at its sandbox's creation: from CRI's annotations, or (ctr, a
    runtime without them) from the containers alone."""
    sandbox = annotations_of(containers) if annotated else ContainerResources()
    return pod_totals(sandbox, containers)


BOOT = dict(containers=pods, kw=configs, annotated=st.booleans())


@settings(**settings_)
@given(**BOOT)
def test_boot_plan(containers, kw, annotated) -> None:
    """Admitted or refused as the rules say (both ways, the refusal naming the reason);
    an admitted plan keeps every promise and explains every number."""
    pod = boot_totals(containers, annotated)
    expected = expected_plan(request(pod, kw), HOST)
    try:
        plan = plan_sandbox(request(pod, kw), HOST)
    except NoFit as exc:
        assert_refusal_expected(str(exc), expected.reasons)
        return  # refusals are a minority here: test_most_boots_and_steps_are_planned
    assert_admission_expected(expected.reasons)
    check_plan(plan, pod, kw)
    assert (plan.vcpus, plan.memory_mib) == (expected.vcpus, expected.memory_mib)
    union = set().union(*(parse_cpu_list(c.cpuset) for c in containers.values() if c.cpuset))
    assert (parse_cpu_list(plan.cpuset) if plan.cpuset else set()) == union
    if kw["sizing"] == "sum":
        assert plan.uncapped_vcpus == math.ceil(kw["default_vcpus"] + (pod.quota_cpus or (
            pod.cpu_shares / 1024 if pod.cpu_shares > 2 else 0)) - 1e-9)
        assert plan.vcpus == min(plan.uncapped_vcpus, plan.max_vcpus)
        assert plan.memory_mib == kw["default_memory_mib"] + math.ceil(pod.memory_limit / MIB)
        # Kubernetes' view (limits + the overhead podvm reports) is what the host gives
        if plan.cgroup_memory_limit != -1:
            assert (plan.workload_memory_mib + plan.overhead_memory_mib) * MIB == \
                plan.cgroup_memory_limit
    # A pod cgroup sized with the reported overhead admits the same plan; a MiB less not.
    if pod.memory_limit:
        allowed = plan.workload_memory_mib + plan.overhead_memory_mib
        fenced = plan_sandbox(request(pod, dict(kw, pod_cgroup_memory_mib=allowed)), HOST)
        assert fenced == replace(plan, pod_cgroup_memory_mib=allowed)
        short = request(pod, dict(kw, pod_cgroup_memory_mib=allowed - 1))
        try:
            plan_sandbox(short, HOST)
        except NoFit as exc:
            assert f"overhead.podFixed.memory >= {plan.overhead_memory_mib}Mi" in str(exc)
        else:
            raise AssertionError(f"a pod cgroup of {allowed - 1} MiB admitted {plan}")
    # Every number of the plan is explained.
    text = " ".join(plan.explanation)
    for number in (plan.vcpus, plan.memory_mib, plan.max_vcpus, plan.max_memory_mib,
                   plan.cgroup_cpu_shares, plan.overhead_memory_mib):
        assert re.search(rf"(?<![\d.]){number}(?![\d.])", text), (number, text)
    if plan.cgroup_cpu_quota > 0:
        assert f"{plan.cgroup_cpu_quota}/{plan.cgroup_cpu_period}" in text
    if plan.cgroup_memory_limit > 0:
        assert f"sandbox cgroup memory {plan.cgroup_memory_limit // MIB} MiB" in text


@dataclass
class Life:
    """What a pod's life came to: how many boots and steps were planned and refused."""

    booted: bool = False
    applied: int = 0
    refused: int = 0


def live(first: dict[str, ContainerResources], steps: list[dict[str, ContainerResources]],
         kw: dict, static: bool) -> Life:
    """Boot from the annotations of the first containers, then the pod's containers
    change. Each boot and step is admitted or refused exactly as the rules say; a refused
    step leaves the plan in force; every plan in force keeps the promises."""
    life = Life()
    sandbox = annotations_of(first)
    req = request(pod_totals(sandbox, {}), kw)
    expected = expected_plan(req, HOST)
    try:
        boot = plan_sandbox(req, HOST)
    except NoFit as exc:
        assert_refusal_expected(str(exc), expected.reasons)
        return life  # no pod: nothing more happens in its life
    assert_admission_expected(expected.reasons)
    life.booted = True
    current = boot
    for containers in (first, *steps):
        pod = pod_totals(sandbox, containers)
        req = request(pod, kw)
        expected = expected_plan(req, HOST)
        try:
            wanted = plan_sandbox(req, HOST)
        except NoFit as exc:
            assert_refusal_expected(str(exc), expected.reasons)
            life.refused += 1
            continue  # refused: the plan in force stays
        assert_admission_expected(expected.reasons)
        reasons = expected_update(current, boot, expected, static, kw["memory_overhead_mib"])
        try:
            delta = plan_update(current, boot, wanted, static)
        except StaticSizeExceeded as exc:
            assert static
            assert_refusal_expected(str(exc), reasons)
            assert exc.fitting is not None
            fit = exc.fitting.plan
            assert (fit.vcpus, fit.memory_mib) == (boot.vcpus, boot.memory_mib)
            assert not exc.fitting.grows and exc.fitting.remove_vcpus == 0
            if fit.cgroup_cpu_quota != -1:
                assert fit.cgroup_cpu_quota <= boot.vcpus * fit.cgroup_cpu_period
            if fit.cgroup_memory_limit != -1:
                assert fit.cgroup_memory_limit == \
                    (boot.memory_mib + kw["memory_overhead_mib"]) * MIB
            assert fit.cpuset == pod.cpuset
            life.refused += 1
            continue
        except NoFit as exc:
            assert not static
            assert_refusal_expected(str(exc), reasons)
            life.refused += 1
            continue  # refused: the plan in force stays
        assert_admission_expected(reasons)
        life.applied += 1
        plan = delta.plan
        check_plan(plan, pod, kw)
        assert plan.cpuset == pod.cpuset
        if static:  # never beyond the boot size, hence never beyond the maxima
            assert (plan.vcpus, plan.memory_mib) == (boot.vcpus, boot.memory_mib)
            assert delta.add_vcpus == delta.remove_vcpus == delta.add_memory_mib == 0
        else:
            assert plan.vcpus == max(boot.vcpus, expected.vcpus)
            assert plan.memory_mib >= current.memory_mib  # never taken back
            assert plan.memory_mib >= expected.memory_mib
            assert (plan.memory_mib - boot.memory_mib) % 128 == 0
            assert delta.remove_vcpus <= current.vcpus - boot.vcpus  # only hot-added ones
            if delta.add_memory_mib == 0 and plan.memory_mib > wanted.memory_mib:
                assert any("never taken back" in n for n in delta.notes) or \
                    plan.memory_mib == current.memory_mib
        assert delta.add_vcpus - delta.remove_vcpus == plan.vcpus - current.vcpus
        assert delta.add_memory_mib == plan.memory_mib - current.memory_mib
        current = plan
    return life


LIFE = dict(first=pods, steps=st.lists(pods, min_size=1, max_size=4), kw=configs,
            static=st.booleans())


@settings(**settings_)
@given(**LIFE)
def test_a_pod_s_life(first, steps, kw, static) -> None:
    """See `live`; how often boots and steps are refused: the test below."""
    live(first, steps, kw, static)


def life_inputs(pick: Pick) -> tuple:
    """The space test_a_pod_s_life draws from."""
    return (pod(pick), [pod(pick) for _ in range(pick.integer(1, 4))], config(pick),
            pick.choice([False, True]))


def test_most_boots_and_steps_are_planned() -> None:
    """The guard against passing vacuously: over a fixed sample of the spaces above, the
    model plans most boots and most steps of a pod's life (each checked against the rules
    as in the properties), and refuses some. A model that refused everything fails here."""
    boots = sample(lambda pick: (pod(pick), config(pick), pick.choice([False, True])))
    refused = 0
    for containers, kw, annotated in boots:
        req = request(boot_totals(containers, annotated), kw)
        expected = expected_plan(req, HOST)
        try:
            plan_sandbox(req, HOST)
        except NoFit:
            assert expected.refused
            refused += 1
        else:
            assert not expected.refused
    assert 0 < refused < len(boots) // 2, refused
    lives = [live(*inputs) for inputs in sample(life_inputs)]
    booted = sum(life.booted for life in lives)
    applied, refused = sum(life.applied for life in lives), sum(life.refused for life in lives)
    assert booted > len(lives) // 2, booted
    assert 0 < refused < applied, (applied, refused)


def test_the_properties_fail_for_a_model_that_refuses_everything(monkeypatch) -> None:
    """The properties above assert plans, not just the absence of errors."""
    def refuse(req: SandboxRequest, host: Host) -> SandboxPlan:
        raise NoFit("the pod needs 1 MiB of VM memory but at most 0 MiB are allowed (host memory)")

    monkeypatch.setattr(sys.modules[__name__], "plan_sandbox", refuse)
    for prop, strategies in ((test_boot_plan, BOOT), (test_a_pod_s_life, LIFE)):
        # the same property and examples; the first failure is all this needs to see
        # (shrinking it took 25 s)
        quick = settings(**settings_, phases=(Phase.generate,), report_multiple_bugs=False)
        assert_fails(quick(given(**strategies)(prop.hypothesis.inner_test)), AssertionError)
