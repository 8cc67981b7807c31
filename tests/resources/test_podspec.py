"""A pod manifest read as Kubernetes sizes it: the API server's defaulting, the effective
requests and limits with init containers and sidecars, and what kubelet hands the node
(CRI's sandbox resources, the pod cgroup)."""
from __future__ import annotations

from fractions import Fraction

import pytest

from shim.resources.model import ContainerResources
from shim.resources.podspec import (PodCgroup, pod_cgroup, pod_limits, pod_requests, read_pod,
                                    sandbox_resources)

MIB = 1 << 20


def container(name: str, requests: dict | None = None, limits: dict | None = None,
              **extra) -> dict:
    resources = {}
    if requests:
        resources["requests"] = requests
    if limits:
        resources["limits"] = limits
    return {"name": name, "image": "busybox", "resources": resources, **extra}


def pod(*containers: dict, init: tuple = (), overhead: dict | None = None,
        annotations: dict | None = None) -> dict:
    spec: dict = {"runtimeClassName": "podvm", "containers": list(containers)}
    if init:
        spec["initContainers"] = list(init)
    if overhead:
        spec["overhead"] = overhead
    metadata: dict = {"name": "p"}
    if annotations:
        metadata["annotations"] = annotations
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec}


def test_a_limit_without_a_request_requests_the_limit() -> None:
    p = read_pod(pod(container("a", limits={"cpu": "1", "memory": "1Gi"}),
                     container("b", requests={"cpu": "250m"}, limits={"cpu": "500m"})))
    assert pod_requests(p) == {"cpu": Fraction(5, 4), "memory": 1 << 30}
    assert pod_limits(p) == {"cpu": Fraction(3, 2), "memory": 1 << 30}


def test_init_containers_count_by_the_largest_against_the_sum() -> None:
    p = read_pod(pod(container("a", limits={"cpu": "1", "memory": "256Mi"}),
                     container("b", limits={"cpu": "1", "memory": "256Mi"}),
                     init=(container("i1", limits={"cpu": "3", "memory": "128Mi"}),
                           container("i2", limits={"cpu": "1", "memory": "1Gi"}))))
    assert pod_limits(p) == {"cpu": 3, "memory": 1 << 30}
    assert pod_requests(p) == {"cpu": 3, "memory": 1 << 30}


def test_sidecars_run_beside_everything_after_them() -> None:
    """KEP-753: a restartable init container adds to the app containers and to every
    init container after it."""
    p = read_pod(pod(container("app", limits={"cpu": "1", "memory": "100Mi"}),
                     init=(container("side", limits={"cpu": "500m", "memory": "50Mi"},
                                     restartPolicy="Always"),
                           container("init", limits={"cpu": "2", "memory": "100Mi"}))))
    assert pod_limits(p) == {"cpu": Fraction(5, 2), "memory": 150 * MIB}


def test_sandbox_resources_are_kubelets() -> None:
    """shares from the request, quota from the limit (period 100 ms), memory limit."""
    p = read_pod(pod(container("a", requests={"cpu": "500m", "memory": "64Mi"},
                               limits={"cpu": "1500m", "memory": "128974848"})))
    assert sandbox_resources(p) == ContainerResources(
        cpu_quota=150_000, cpu_period=100_000, cpu_shares=512, memory_limit=128974848)
    none = read_pod(pod(container("a")))
    assert sandbox_resources(none) == ContainerResources(cpu_quota=0, cpu_period=100_000,
                                                         cpu_shares=2, memory_limit=0)
    tiny = read_pod(pod(container("a", limits={"cpu": "1m"})))
    assert sandbox_resources(tiny).cpu_quota == 1000  # kubelet's least quota: 1 ms


def test_pod_cgroup_is_limited_only_where_every_container_has_a_limit() -> None:
    overhead = {"cpu": "1", "memory": "448Mi"}
    both = read_pod(pod(container("a", limits={"cpu": "2", "memory": "512Mi"}),
                        init=(container("i", limits={"cpu": "1", "memory": "64Mi"}),),
                        overhead=overhead))
    assert pod_cgroup(both) == PodCgroup(memory_bytes=512 * MIB,
                                         overhead_memory_bytes=448 * MIB, cpus=3.0)
    partial = read_pod(pod(container("a", limits={"cpu": "2", "memory": "512Mi"}),
                           container("b", limits={"memory": "64Mi"}), overhead=overhead))
    assert pod_cgroup(partial) == PodCgroup(memory_bytes=576 * MIB,
                                            overhead_memory_bytes=448 * MIB, cpus=0.0)


def test_other_resources_are_not_read() -> None:
    p = read_pod(pod(container("a", limits={"nvidia.com/gpu": "1", "ephemeral-storage": "2Gi",
                                            "memory": "1Gi"})))
    assert pod_limits(p) == {"memory": 1 << 30}  # ephemeral-storage sizes the disk instead
    assert p.containers[0].storage_limit == 2 << 30


@pytest.mark.parametrize("manifest,where", [
    (pod(container("a", limits={"cpu": "two"})), "spec.containers[0].resources.limits.cpu"),
    (pod(container("a", requests={"memory": "1GB"})),
     "spec.containers[0].resources.requests.memory"),
    (pod(container("a"), init=(container("i", limits={"memory": "-1Gi"}),)),
     "spec.initContainers[0].resources.limits.memory"),
    (pod(), "spec.containers"),
    (pod(container("a", limits={"ephemeral-storage": "x"})),
     "spec.containers[0].resources.limits.ephemeral-storage"),
    ({"spec": {"containers": "a"}}, "spec.containers"),
    ({"metadata": {"annotations": {"a": 1}}, "spec": {}}, "metadata.annotations"),
    ({"spec": {"runtimeClassName": 7, "containers": [{}]}}, "spec.runtimeClassName"),
    ([], "the pod"),
])
def test_what_cannot_be_read_names_its_field(manifest, where) -> None:
    with pytest.raises(ValueError) as refused:
        read_pod(manifest)
    assert where in str(refused.value)
