"""The model's promises over pod shapes Kubernetes produces (limits only, requests and
limits, requests only, none, several containers, cpusets, CFS quota disabled), through a
pod's life: boot from the sandbox annotations, containers created and updated, in static
and dynamic mode."""
from __future__ import annotations

import math
import re
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from cgroups.limits import parse_cpu_list
from shim.resources import (ContainerResources, Host, NoFit, PlanError, SandboxPlan,
                            SandboxRequest, StaticSizeExceeded, plan_sandbox, plan_update,
                            pod_totals)

MIB = 1 << 20
HOST = Host(cpus=16, memory_mib=64 * 1024)
PERIOD = 100_000


@st.composite
def container(draw) -> ContainerResources:
    kind = draw(st.sampled_from(["limits", "requests+limits", "requests", "none",
                                 "quota-disabled"]))
    limit = draw(st.integers(1, 40)) / 10  # CPUs
    request = min(limit, draw(st.integers(1, 40)) / 10)
    memory = draw(st.integers(1, 1024)) * MIB
    cpuset = draw(st.sampled_from(["", "0", "1-2", "3", "0-3", "8-11,14"]))
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
    quota, period = draw(st.sampled_from([(-1, PERIOD), (0, 0)]))
    return ContainerResources(quota, period, int(limit * 1024), memory, cpuset)


def annotations_of(containers: dict[str, ContainerResources]) -> ContainerResources:
    """What containerd's CRI puts on the sandbox: the pod's totals."""
    quota_cpus = sum(c.quota_cpus for c in containers.values())
    return ContainerResources(cpu_quota=math.ceil(quota_cpus * PERIOD) if quota_cpus else 0,
                              cpu_period=PERIOD if quota_cpus else 0,
                              cpu_shares=sum(c.cpu_shares for c in containers.values()),
                              memory_limit=sum(c.memory_limit for c in containers.values()))


pods = st.dictionaries(st.sampled_from(["a", "b", "c", "d"]), container(), max_size=4)
settings_ = dict(max_examples=300, deadline=None)


def request(pod: ContainerResources, kw: dict) -> SandboxRequest:
    return SandboxRequest(pod=pod, **kw)


configs = st.fixed_dictionaries({
    "default_vcpus": st.integers(1, 3), "default_memory_mib": st.sampled_from([128, 256, 2048]),
    "max_vcpus": st.sampled_from([0, 8, 12]), "max_memory_mib": st.sampled_from([0, 4096, 8192]),
    "sizing": st.sampled_from(["sum", "max"]), "memory_overhead_mib": st.sampled_from([0, 256])})


def check_plan(plan: SandboxPlan, pod: ContainerResources, kw: dict) -> None:
    """What every plan in force promises."""
    assert plan.vcpus >= math.ceil(pod.quota_cpus - 1e-9) and plan.vcpus >= 1
    assert plan.vcpus <= plan.max_vcpus and plan.memory_mib <= plan.max_memory_mib
    assert plan.memory_mib >= math.ceil(pod.memory_limit / MIB)
    if plan.cgroup_memory_limit != -1:  # -1: the pod has no memory limit at all
        assert plan.cgroup_memory_limit >= (plan.memory_mib + kw["memory_overhead_mib"]) * MIB
    else:
        assert pod.memory_limit == 0
    if plan.cgroup_cpu_quota != -1:
        assert plan.cgroup_cpu_quota / plan.cgroup_cpu_period >= pod.quota_cpus
    assert plan.cgroup_cpu_shares >= 2


@settings(**settings_)
@given(containers=pods, kw=configs, annotated=st.booleans())
def test_boot_plan(containers, kw, annotated) -> None:
    sandbox = annotations_of(containers) if annotated else ContainerResources()
    pod = pod_totals(sandbox, containers)
    try:
        plan = plan_sandbox(request(pod, kw), HOST)
    except NoFit as exc:
        assert re.search(r"\d", str(exc))  # the numbers are in the message
        return
    check_plan(plan, pod, kw)
    union = set().union(*(parse_cpu_list(c.cpuset) for c in containers.values() if c.cpuset))
    assert (parse_cpu_list(plan.cpuset) if plan.cpuset else set()) == union
    if kw["sizing"] == "sum":
        assert plan.vcpus == math.ceil(kw["default_vcpus"] + (pod.quota_cpus or (
            pod.cpu_shares / 1024 if pod.cpu_shares > 2 else 0)) - 1e-9)
        assert plan.memory_mib == kw["default_memory_mib"] + math.ceil(pod.memory_limit / MIB)
        # Kubernetes' view (limits + the overhead podvm reports) is what the host gives
        if plan.cgroup_memory_limit != -1:
            assert (plan.workload_memory_mib + plan.overhead_memory_mib) * MIB == \
                plan.cgroup_memory_limit
    # A pod cgroup sized with the reported overhead admits the same plan.
    if pod.memory_limit:
        fenced = plan_sandbox(request(pod, dict(kw, pod_cgroup_memory_mib=(
            plan.workload_memory_mib + plan.overhead_memory_mib))), HOST)
        assert fenced == replace(plan, pod_cgroup_memory_mib=fenced.pod_cgroup_memory_mib)
    # Every number of the plan is explained.
    text = " ".join(plan.explanation)
    for number in (plan.vcpus, plan.memory_mib, plan.max_vcpus, plan.max_memory_mib,
                   plan.cgroup_cpu_shares, plan.overhead_memory_mib):
        assert re.search(rf"(?<![\d.]){number}(?![\d.])", text), (number, text)
    if plan.cgroup_cpu_quota > 0:
        assert f"{plan.cgroup_cpu_quota}/{plan.cgroup_cpu_period}" in text
    if plan.cgroup_memory_limit > 0:
        assert f"sandbox cgroup memory {plan.cgroup_memory_limit // MIB} MiB" in text


@settings(**settings_)
@given(first=pods, steps=st.lists(pods, min_size=1, max_size=4), kw=configs,
       static=st.booleans())
def test_a_pod_s_life(first, steps, kw, static) -> None:
    """Boot from the annotations of the first containers, then the pod's containers
    change; a refused step leaves the plan in force."""
    sandbox = annotations_of(first)
    try:
        boot = plan_sandbox(request(pod_totals(sandbox, {}), kw), HOST)
    except PlanError:
        return
    current = boot
    for containers in (first, *steps):
        pod = pod_totals(sandbox, containers)
        try:
            wanted = plan_sandbox(request(pod, kw), HOST)
            delta = plan_update(current, boot, wanted, static)
        except StaticSizeExceeded as exc:
            assert static and exc.fitting is not None and re.search(r"\d+ MiB|\d+ vCPUs",
                                                                    str(exc))
            fit = exc.fitting.plan
            assert (fit.vcpus, fit.memory_mib) == (boot.vcpus, boot.memory_mib)
            assert not exc.fitting.grows and exc.fitting.remove_vcpus == 0
            if fit.cgroup_cpu_quota != -1:
                assert fit.cgroup_cpu_quota <= boot.vcpus * fit.cgroup_cpu_period
            if fit.cgroup_memory_limit != -1:
                assert fit.cgroup_memory_limit == \
                    (boot.memory_mib + kw["memory_overhead_mib"]) * MIB
            assert fit.cpuset == pod.cpuset
            continue
        except NoFit:
            continue  # refused: the plan in force stays
        plan = delta.plan
        check_plan(plan, pod, kw)
        assert plan.cpuset == pod.cpuset
        if static:  # never beyond the boot size, hence never beyond the maxima
            assert (plan.vcpus, plan.memory_mib) == (boot.vcpus, boot.memory_mib)
            assert delta.add_vcpus == delta.remove_vcpus == delta.add_memory_mib == 0
        else:
            assert plan.vcpus >= boot.vcpus
            assert plan.memory_mib >= current.memory_mib  # never taken back
            assert (plan.memory_mib - boot.memory_mib) % 128 == 0
            assert delta.remove_vcpus <= current.vcpus - boot.vcpus  # only hot-added ones
            if delta.add_memory_mib == 0 and plan.memory_mib > wanted.memory_mib:
                assert any("never taken back" in n for n in delta.notes) or \
                    plan.memory_mib == current.memory_mib
        assert delta.add_vcpus - delta.remove_vcpus == plan.vcpus - current.vcpus
        assert delta.add_memory_mib == plan.memory_mib - current.memory_mib
        current = plan
