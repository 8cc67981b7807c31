"""Both APIs plan a pod from the same inputs: the same pod, created through the Task API
(the sandbox container's annotations and the pod cgroup kubelet made) or through the
Sandbox API (a PodSandboxConfig), gets the same plan, refusals included."""
from __future__ import annotations

import pytest

from podvm_core.pb.cri import api_pb2 as cri
from shim.config import Config
from shim.resources.planner import PodPlanner, pod_cgroup_memory_mib
from shim.resources import Host, NoFit

MIB = 1 << 20
HOST = Host(cpus=16, memory_mib=64 * 1024)
PERIOD = 100_000


def through_the_task_api(quota: int, memory: int, shares: int, overhead_quota: int,
                         overhead_memory: int) -> PodPlanner:
    annotations = {"io.kubernetes.cri.sandbox-cpu-period": str(PERIOD),
                   "io.kubernetes.cri.sandbox-cpu-quota": str(quota),
                   "io.kubernetes.cri.sandbox-cpu-shares": str(shares),
                   "io.kubernetes.cri.sandbox-memory": str(memory)}
    spec = {"annotations": annotations, "linux": {"cgroupsPath": "/kubepods/pod1/sb"}}
    # kubelet's pod cgroup: the limits plus the RuntimeClass overhead, as the shim reads it
    cgroup_memory = pod_cgroup_memory_mib(memory, overhead_memory)
    cgroup_cpus = (quota + overhead_quota) / PERIOD if quota > 0 else 0.0
    return PodPlanner.for_sandbox(Config(), spec, HOST, cgroup_memory, cgroup_cpus)


def through_the_sandbox_api(quota: int, memory: int, shares: int, overhead_quota: int,
                            overhead_memory: int) -> PodPlanner:
    pod = cri.PodSandboxConfig()
    r = pod.linux.resources
    r.cpu_period, r.cpu_quota, r.cpu_shares, r.memory_limit_in_bytes = \
        PERIOD, quota, shares, memory
    o = pod.linux.overhead
    o.cpu_period, o.cpu_quota, o.memory_limit_in_bytes = PERIOD, overhead_quota, \
        overhead_memory
    return PodPlanner.for_pod_config(Config(), pod, {}, HOST)


SHAPES = [  # quota, memory, shares, overhead quota, overhead memory
    (150_000, 512 * MIB, 1536, 100_000, 448 * MIB),
    (100_000, 100_000_000, 1024, 100_000, 448 * MIB),  # a decimal memory limit
    (250_000, 2048 * MIB, 2560, 150_000, 512 * MIB),
    (0, 0, 2, 0, 0),  # best effort: no limits, no pod cgroup limits
]


@pytest.mark.parametrize("shape", SHAPES)
def test_one_pod_gets_one_plan_through_either_api(shape) -> None:
    task, sandbox = through_the_task_api(*shape), through_the_sandbox_api(*shape)
    assert task.plan() == sandbox.plan()


@pytest.mark.parametrize("overhead_quota, overhead_memory, reason", [
    (50_000, 448 * MIB, "overhead.podFixed.cpu"),
    (100_000, 64 * MIB, "overhead.podFixed.memory"),
])
def test_an_overhead_too_small_is_refused_alike(overhead_quota, overhead_memory,
                                                reason) -> None:
    shape = (100_000, 512 * MIB, 1024, overhead_quota, overhead_memory)
    messages = []
    for build in (through_the_task_api, through_the_sandbox_api):
        with pytest.raises(NoFit) as err:
            build(*shape).plan()
        messages.append(str(err.value))
    assert messages[0] == messages[1] and reason in messages[0]
