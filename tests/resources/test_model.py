"""The sizing rules, example by example and as properties over pod shapes."""
from __future__ import annotations

import math
import sys
from dataclasses import replace
from functools import partial

import pytest
from hypothesis import given, settings

from shim.resources import (ContainerResources, Host, NoFit, PlanError, SandboxPlan,
                            SandboxRequest, plan_sandbox)
from shim.resources.annotations import apply_kata_overrides, pod_resources

from .oracle import assert_admission_expected, assert_refusal_expected, expected_plan
from .picks import Pick, assert_fails, either, sample, strategy

MIB = 1 << 20
HOST = Host(cpus=16, memory_mib=64 * 1024)


def request(pod: ContainerResources, **kw) -> SandboxRequest:
    fields = dict(pod=pod, default_vcpus=1, default_memory_mib=256, max_vcpus=0,
                  max_memory_mib=0)
    fields.update(kw)
    return SandboxRequest(**fields)


def test_issue_example_2_5_cpus_and_512_mib() -> None:
    pod = ContainerResources(cpu_quota=250_000, cpu_period=100_000, memory_limit=512 * MIB)
    plan = plan_sandbox(request(pod), HOST)
    assert (plan.vcpus, plan.memory_mib) == (4, 768)
    assert plan.cgroup_memory_limit >= 768 * MIB
    assert plan.overhead_memory_mib == 256 and plan.explanation


def test_static_cpu_manager_uses_shares_and_besteffort_adds_nothing() -> None:
    assert plan_sandbox(request(ContainerResources(cpu_quota=-1, cpu_period=100_000,
                                                   cpu_shares=2048)), HOST).vcpus == 3
    assert plan_sandbox(request(ContainerResources(cpu_shares=2)), HOST).vcpus == 1
    # CFS quota disabled: quota = period = 0 is not "zero CPUs"
    assert plan_sandbox(request(ContainerResources(cpu_shares=4096)), HOST).vcpus == 5


def test_no_limits_gives_the_defaults_and_max_policy() -> None:
    plan = plan_sandbox(request(ContainerResources()), HOST)
    assert (plan.vcpus, plan.memory_mib, plan.cgroup_memory_limit) == (1, 256, -1)
    pod = ContainerResources(cpu_quota=300_000, cpu_period=100_000, memory_limit=128 * MIB)
    plan = plan_sandbox(request(pod, sizing="max"), HOST)
    assert (plan.vcpus, plan.memory_mib) == (3, 256)


def test_issue_example_1_5_cpus_on_a_2_cpu_host_runs_with_2_vcpus() -> None:
    """Kubernetes admits a 1.5 CPU limit on a 2-CPU node: the VM gets the host's 2 CPUs,
    the sandbox cgroup the pod's 1.5 CPUs plus the guest's own."""
    pod = ContainerResources(cpu_quota=150_000, cpu_period=100_000, memory_limit=128 * MIB)
    plan = plan_sandbox(request(pod), Host(cpus=2, memory_mib=4096))
    assert (plan.vcpus, plan.uncapped_vcpus, plan.max_vcpus) == (2, 3, 2)
    assert (plan.cgroup_cpu_quota, plan.cgroup_cpu_period) == (250_000, 100_000)
    assert "vCPUs capped at 2 (the host CPUs) instead of 3" in " ".join(plan.explanation)


@pytest.mark.parametrize("pod, kw, cap, uncapped, bound", [
    (ContainerResources(cpu_quota=2_000_000, cpu_period=100_000), {}, 16, 21,
     "the host CPUs"),
    (ContainerResources(cpu_quota=400_000, cpu_period=100_000), {"max_vcpus": 4}, 4, 5,
     "default_maxvcpus"),
    (ContainerResources(cpu_quota=-1, cpu_period=100_000, cpu_shares=8192), {"max_vcpus": 4},
     4, 9, "default_maxvcpus"),
    (ContainerResources(), {"default_vcpus": 6, "max_vcpus": 4}, 4, 6, "default_maxvcpus"),
])
def test_vcpus_beyond_the_maximum_are_capped_and_the_cgroup_keeps_what_the_pod_asked(
        pod, kw, cap, uncapped, bound) -> None:
    plan = plan_sandbox(request(pod, **kw), HOST)
    assert (plan.vcpus, plan.uncapped_vcpus) == (cap, uncapped)
    assert f"vCPUs capped at {cap} ({bound}) instead of {uncapped}" in \
        " ".join(plan.explanation)
    uncapped_plan = plan_sandbox(request(pod, **{**kw, "max_vcpus": 64}), Host(64, 65536))
    assert (plan.cgroup_cpu_quota, plan.cgroup_cpu_shares) == \
        (uncapped_plan.cgroup_cpu_quota, uncapped_plan.cgroup_cpu_shares)
    assert uncapped_plan.vcpus == uncapped_plan.uncapped_vcpus == uncapped
    assert "capped" not in " ".join(uncapped_plan.explanation)


def test_a_capped_pod_whose_memory_cannot_fit_is_still_refused() -> None:
    pod = ContainerResources(cpu_quota=400_000, cpu_period=100_000, memory_limit=1024 * MIB)
    with pytest.raises(NoFit, match="1280 MiB of VM memory but at most 1024 MiB"):
        plan_sandbox(request(pod, max_vcpus=2, max_memory_mib=1024), HOST)


@pytest.mark.parametrize("pod, kw, message", [
    (ContainerResources(memory_limit=100 * 1024 * MIB), {}, "host memory"),
    (ContainerResources(memory_limit=1024 * MIB), {"max_memory_mib": 1024}, "default_maxmemory"),
])
def test_plans_that_do_not_fit_are_refused_with_numbers(pod, kw, message) -> None:
    with pytest.raises(PlanError, match=message):
        plan_sandbox(request(pod, **kw), HOST)


def test_annotations() -> None:
    ann = {"io.kubernetes.cri.sandbox-cpu-quota": "50000",
           "io.kubernetes.cri.sandbox-cpu-period": "100000",
           "io.kubernetes.cri.sandbox-memory": str(64 * MIB),
           "io.katacontainers.config.hypervisor.default_vcpus": "2"}
    pod = pod_resources(ann)
    assert (pod.quota_cpus, pod.memory_limit) == (0.5, 64 * MIB)
    with pytest.raises(PlanError, match="enable_annotations in /etc/podvm/c.toml"):
        apply_kata_overrides(request(pod), ann, (), "/etc/podvm/c.toml")
    req = apply_kata_overrides(request(pod), ann, ("default_vcpus",), "x")
    assert plan_sandbox(req, HOST).vcpus == 3
    with pytest.raises(PlanError, match="not an integer"):
        pod_resources({"io.kubernetes.cri.sandbox-memory": "lots"})
    with pytest.raises(PlanError, match="not supported"):
        apply_kata_overrides(request(pod), {"io.katacontainers.config.hypervisor.kernel": "x"},
                             ("kernel",), "x")


def test_qemu_s_overhead_must_fit_the_host_too() -> None:
    """A VM within the host's memory can still not fit once QEMU's own memory is added."""
    small = Host(cpus=4, memory_mib=1024)
    req = request(ContainerResources(memory_limit=700 * MIB), memory_overhead_mib=200)
    with pytest.raises(NoFit, match="956 MiB \\+ 200 MiB QEMU overhead but the host has "
                                    "1024 MiB"):
        plan_sandbox(req, small)
    assert plan_sandbox(replace(req, memory_overhead_mib=68), small).memory_mib == 956


# The generated space: a pod's totals as Kubernetes and containerd may pass them (CFS
# quota disabled as -1 or 0/0, BestEffort's 2 shares), and the configuration around them.
MAX_DEFAULT_VCPUS = 4


def pod_shape(pick: Pick, fitting: bool) -> ContainerResources:
    """`fitting`: a CPU limit the host holds beside the largest default vCPUs (memory
    always fits: 8 GiB + defaults on a 64 GiB host), so that the plan must be admitted."""
    period = either(pick, (0,), 1_000, 1_000_000)
    quota_max = 800_000  # up to 800 CPUs at the shortest period: many do not fit
    if fitting and period:
        quota_max = min(quota_max, (HOST.cpus - MAX_DEFAULT_VCPUS) * period)
    return ContainerResources(cpu_quota=either(pick, (0, -1), 1_000, quota_max),
                              cpu_period=period,
                              cpu_shares=either(pick, (0, 2), 2, 8 * 1024),
                              memory_limit=either(pick, (0,), 1, 8 * 1024) * MIB)


def sandbox_request(pick: Pick, fitting: bool = False) -> SandboxRequest:
    """Not `fitting`: maxima below the host's too, so every refusal reason but the pod
    cgroup's can come up (those have their own test)."""
    return request(pod_shape(pick, fitting),
                   default_vcpus=pick.integer(1, MAX_DEFAULT_VCPUS),
                   default_memory_mib=pick.integer(64, 2048),
                   sizing=pick.choice(["sum", "max"]),
                   memory_overhead_mib=pick.integer(0, 300),
                   max_vcpus=0 if fitting else pick.choice([0, 0, 8]),
                   max_memory_mib=0 if fitting else pick.choice([0, 0, 8192]))


fitting_requests = strategy(partial(sandbox_request, fitting=True))
any_requests = strategy(sandbox_request)
PROPERTIES = settings(max_examples=200, deadline=None, derandomize=True)


@PROPERTIES
@given(req=fitting_requests)
def test_pods_that_fit_are_planned_by_the_rules(req: SandboxRequest) -> None:
    """Every input here fits: a refusal fails the test, and the plan is the rules' size."""
    expected = expected_plan(req, HOST)
    assert not expected.refused, expected.reasons  # the strategy's promise
    plan = plan_sandbox(req, HOST)
    pod = req.pod
    assert (plan.vcpus, plan.memory_mib) == (expected.vcpus, expected.memory_mib)
    assert plan.uncapped_vcpus == expected.uncapped_vcpus
    assert (plan.cgroup_cpu_quota, plan.cgroup_cpu_period) == \
        (expected.cgroup_cpu_quota, expected.cgroup_cpu_period)
    assert plan.vcpus <= plan.max_vcpus and plan.memory_mib <= plan.max_memory_mib
    assert plan.vcpus >= math.ceil(pod.quota_cpus) and plan.vcpus >= req.default_vcpus
    assert plan.memory_mib >= max(req.default_memory_mib, math.ceil(pod.memory_limit / MIB))
    if plan.cgroup_memory_limit != -1:
        assert plan.cgroup_memory_limit >= (plan.memory_mib + req.memory_overhead_mib) * MIB
    else:
        assert pod.memory_limit == 0
    if plan.cgroup_cpu_quota != -1:
        assert plan.cgroup_cpu_quota / plan.cgroup_cpu_period >= pod.quota_cpus


@PROPERTIES
@given(req=any_requests)
def test_plans_are_refused_exactly_when_the_rules_say_so(req: SandboxRequest) -> None:
    """Both ways: a refusal the rules do not call for fails, and so does a plan they
    refuse; a refusal names the resource and its numbers."""
    expected = expected_plan(req, HOST)
    try:
        plan = plan_sandbox(req, HOST)
    except NoFit as exc:
        assert_refusal_expected(str(exc), expected.reasons)
        return
    assert_admission_expected(expected.reasons)
    assert (plan.vcpus, plan.memory_mib) == (expected.vcpus, expected.memory_mib)
    assert (plan.cgroup_cpu_quota, plan.cgroup_cpu_period) == \
        (expected.cgroup_cpu_quota, expected.cgroup_cpu_period)


@PROPERTIES
@given(req=any_requests)
def test_vcpus_are_capped_never_refused(req: SandboxRequest) -> None:
    """A pod is never refused for CPU: its vCPUs stop at the VM's maximum, the plan says
    so, and the sandbox cgroup's quota stays what the pod asked."""
    expected = expected_plan(req, HOST)
    try:
        plan = plan_sandbox(req, HOST)
    except NoFit as exc:  # memory alone: the rules give no reason about CPUs
        assert_refusal_expected(str(exc), expected.reasons)
        assert "vCPU" not in str(exc)
        return
    assert plan.vcpus == min(expected.uncapped_vcpus, req.max_vcpus or HOST.cpus)
    assert plan.uncapped_vcpus == expected.uncapped_vcpus
    capped = f"vCPUs capped at {plan.vcpus}"
    assert (capped in " ".join(plan.explanation)) == (plan.uncapped_vcpus > plan.vcpus)
    assert plan.cgroup_cpu_quota == expected.cgroup_cpu_quota


@PROPERTIES
@given(req=fitting_requests)
def test_a_pod_cgroup_with_the_reported_overhead_admits_the_plan(req: SandboxRequest) -> None:
    """kubelet sizes the pod cgroup as the containers' limits plus the RuntimeClass
    overhead: with the overhead the plan reports it is admitted unchanged; a MiB or a
    microsecond less is refused, saying which overhead to declare."""
    plan = plan_sandbox(req, HOST)
    memory = plan.workload_memory_mib + plan.overhead_memory_mib
    fenced = plan_sandbox(replace(req, pod_cgroup_memory_mib=memory), HOST)
    assert fenced == replace(plan, pod_cgroup_memory_mib=memory)
    with pytest.raises(NoFit, match=f"allows {memory - 1} MiB.*overhead.podFixed.memory >= "
                                    f"{plan.overhead_memory_mib}Mi"):
        plan_sandbox(replace(req, pod_cgroup_memory_mib=memory - 1), HOST)
    if plan.cgroup_cpu_quota == -1:  # no CPU limit: kubelet sets no pod quota either
        return
    period = req.pod.cpu_period
    quota = req.pod.cpu_quota + plan.overhead_cpu_millis * period // 1000
    assert plan_sandbox(replace(req, pod_cgroup_cpus=quota / period), HOST) == plan
    with pytest.raises(NoFit, match=f"overhead.podFixed.cpu >= {plan.overhead_cpu_millis}m"):
        plan_sandbox(replace(req, pod_cgroup_cpus=(quota - 1) / period), HOST)


def test_most_generated_pods_are_planned() -> None:
    """The guard against passing vacuously: over a fixed sample of the properties' space
    the model plans most pods, refuses exactly those the rules refuse, and plans every
    pod of the fitting space. A model that refused everything fails here."""
    refused = 0
    for req in sample(sandbox_request):
        expected = expected_plan(req, HOST)
        try:
            plan_sandbox(req, HOST)
        except NoFit:
            assert expected.refused, req
            refused += 1
        else:
            assert not expected.refused, req
    assert 0 < refused < len(sample(sandbox_request)) // 2, refused
    for req in sample(partial(sandbox_request, fitting=True)):
        plan_sandbox(req, HOST)


def test_the_properties_fail_for_a_model_that_refuses_everything(monkeypatch) -> None:
    """The properties above assert plans, not just the absence of errors."""
    def refuse(req: SandboxRequest, host: Host) -> SandboxPlan:
        raise NoFit("the pod needs 1 MiB of VM memory but at most 0 MiB are allowed (host memory)")

    monkeypatch.setattr(sys.modules[__name__], "plan_sandbox", refuse)
    for prop in (test_pods_that_fit_are_planned_by_the_rules,
                 test_plans_are_refused_exactly_when_the_rules_say_so,
                 test_vcpus_are_capped_never_refused,
                 test_a_pod_cgroup_with_the_reported_overhead_admits_the_plan):
        assert_fails(prop, NoFit, AssertionError)
