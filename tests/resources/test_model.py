"""The sizing rules, example by example and as properties over pod shapes."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shim.resources import ContainerResources, Host, PlanError, SandboxRequest, plan_sandbox
from shim.resources.annotations import apply_kata_overrides, pod_resources

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


@pytest.mark.parametrize("pod, kw, message", [
    (ContainerResources(cpu_quota=2_000_000, cpu_period=100_000), {}, "21 vCPUs but at most 16"),
    (ContainerResources(cpu_quota=400_000, cpu_period=100_000), {"max_vcpus": 4},
     "default_maxvcpus"),
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


shapes = st.builds(
    ContainerResources,
    cpu_quota=st.one_of(st.just(0), st.just(-1), st.integers(1_000, 800_000)),
    cpu_period=st.one_of(st.just(0), st.integers(1_000, 1_000_000)),
    cpu_shares=st.one_of(st.just(0), st.just(2), st.integers(2, 8 * 1024)),
    memory_limit=st.one_of(st.just(0), st.integers(1, 8 * 1024) .map(lambda m: m * MIB)))


@settings(deadline=None)
@given(pod=shapes, default_vcpus=st.integers(1, 4), default_mem=st.integers(64, 2048),
       sizing=st.sampled_from(["sum", "max"]), overhead=st.integers(0, 300))
def test_properties(pod, default_vcpus, default_mem, sizing, overhead) -> None:
    req = request(pod, default_vcpus=default_vcpus, default_memory_mib=default_mem,
                  sizing=sizing, memory_overhead_mib=overhead)
    try:
        plan = plan_sandbox(req, HOST)
    except PlanError:
        return
    assert plan.vcpus <= plan.max_vcpus and plan.memory_mib <= plan.max_memory_mib
    assert plan.vcpus >= math.ceil(pod.quota_cpus)
    assert plan.vcpus >= default_vcpus
    assert plan.memory_mib >= max(default_mem, math.ceil(pod.memory_limit / MIB))
    if plan.cgroup_memory_limit != -1:
        assert plan.cgroup_memory_limit >= (plan.memory_mib + overhead) * MIB
    if plan.cgroup_cpu_quota != -1:
        assert plan.cgroup_cpu_quota / plan.cgroup_cpu_period >= pod.quota_cpus
