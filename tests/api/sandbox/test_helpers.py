"""The pure parts of the Sandbox API: where the sandbox cgroup goes for each cgroup
parent syntax, and the pod's totals from a PodSandboxConfig."""
from __future__ import annotations

from podvm_core.pb.cri import api_pb2 as cri
from shim.resources import ContainerResources
from shim.resources.planner import pod_resources as _pod_resources
from shim.api.sandbox.request import _cgroups_path


def test_the_sandbox_goes_under_the_cgroup_parent_in_its_syntax() -> None:
    assert _cgroups_path("/kubepods/burstable/poduid", "sb1") == "/kubepods/burstable/poduid/sb1"
    assert _cgroups_path("/kubepods/poduid/", "sb1") == "/kubepods/poduid/sb1"
    assert _cgroups_path("kubepods-burstable-poduid.slice", "sb1") == \
        "kubepods-burstable-poduid.slice:cri-containerd:sb1"
    assert _cgroups_path("", "sb1") == ""


def test_pod_totals_from_a_pod_sandbox_config() -> None:
    config = cri.PodSandboxConfig()
    assert _pod_resources(config) == ContainerResources()
    r = config.linux.resources
    r.cpu_period, r.cpu_quota, r.cpu_shares = 100_000, 250_000, 2560
    r.memory_limit_in_bytes, r.cpuset_cpus = 1 << 30, "0-1"
    assert _pod_resources(config) == ContainerResources(
        cpu_quota=250_000, cpu_period=100_000, cpu_shares=2560, memory_limit=1 << 30,
        cpuset="0-1")
    r.memory_limit_in_bytes, r.cpu_quota = -1, -1  # unset, as newer kubelets send
    totals = _pod_resources(config)
    assert totals.memory_limit == 0 and totals.quota_cpus == 0
