"""A running pod's resources change: containers are created, updated and removed. The
pod's totals are recomputed from every container, the plan from the totals, and the step
from the plan in force to the new one is a `PlanDelta` the actuators carry out. Pure.

- totals: per dimension, the larger of what the sandbox said at boot (CRI's sandbox
  annotations: the pod's limits as Kubernetes admitted it) and the sum over the pod's
  containers now (a container updated beyond that grows the pod); cpuset: the union of
  the cpusets the containers have ('' = no restriction when none has one: kubelet's
  static CPU manager gives every container of the node a cpuset, the none policy none).
- dynamic mode: vCPUs follow the plan (hot-plug up; unplug only what was hot-added);
  memory grows in whole hot-plug blocks and is never taken back.
- static mode (no hot-plug, confidential VMs): the VM keeps its boot size; a plan larger
  than it is refused with the numbers; anything within it is applied.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Mapping

from .model import MIB, ContainerResources, PlanError, SandboxPlan

DEFAULT_PERIOD_US = 100_000


class StaticSizeExceeded(PlanError):
    """Growth beyond the boot size of a VM that cannot be hot-plugged (static mode)."""


def pod_totals(sandbox: ContainerResources,
               containers: Mapping[str, ContainerResources]) -> ContainerResources:
    """What the pod uses in all: see the module's docstring."""
    cpus = max(sandbox.quota_cpus, sum(c.quota_cpus for c in containers.values()))
    shares = max(sandbox.cpu_shares, sum(max(c.cpu_shares, 0) for c in containers.values()))
    memory = max(sandbox.memory_limit,
                 sum(max(c.memory_limit, 0) for c in containers.values()))
    if cpus > 0:
        period = sandbox.cpu_period if sandbox.quota_cpus == cpus and sandbox.cpu_period > 0 \
            else DEFAULT_PERIOD_US
        quota = math.ceil(cpus * period)
    else:
        quota, period = sandbox.cpu_quota, sandbox.cpu_period
    return ContainerResources(cpu_quota=quota, cpu_period=period, cpu_shares=shares,
                              memory_limit=memory,
                              cpuset=cpuset_union(c.cpuset for c in containers.values()))


def cpuset_union(cpusets) -> str:
    """Kernel list syntax in, canonical kernel list syntax out; '' = no restriction."""
    from cgroups.limits import format_cpu_list, parse_cpu_list

    cpus: set[int] = set()
    for text in cpusets:
        if text:
            cpus |= parse_cpu_list(text, "cpuset")
    return format_cpu_list(cpus)


@dataclass(frozen=True)
class PlanDelta:
    """From the plan in force to `plan`: what the hypervisor and the guest must do. The
    host cgroup limits are `plan`'s (written before a grow, after a shrink)."""

    plan: SandboxPlan
    add_vcpus: int = 0
    remove_vcpus: int = 0
    add_memory_mib: int = 0
    notes: tuple[str, ...] = field(default=(), compare=False)

    @property
    def grows(self) -> bool:
        return bool(self.add_vcpus or self.add_memory_mib)


def plan_update(current: SandboxPlan, boot: SandboxPlan, wanted: SandboxPlan, static: bool,
                memory_block_mib: int = 128) -> PlanDelta:
    """`current`: the plan in force (what the VM has now); `boot`: the plan it booted
    with; `wanted`: the plan for the pod's new totals (from plan_sandbox)."""
    notes: list[str] = []
    if static:
        over = []
        if wanted.vcpus > boot.vcpus:
            over.append(f"{wanted.vcpus} vCPUs (the VM has {boot.vcpus})")
        if wanted.memory_mib > boot.memory_mib:
            over.append(f"{wanted.memory_mib} MiB (the VM has {boot.memory_mib} MiB)")
        if over:
            raise StaticSizeExceeded(
                f"the pod now needs {' and '.join(over)}, but static_sandbox_resource_mgmt "
                f"sizes the VM once at boot: no CPU or memory can be added; recreate the pod "
                f"with larger limits")
        vcpus, memory = current.vcpus, current.memory_mib
    else:
        vcpus = max(boot.vcpus, wanted.vcpus)
        memory = current.memory_mib
        if wanted.memory_mib > current.memory_mib:
            memory += math.ceil((wanted.memory_mib - current.memory_mib) / memory_block_mib) \
                * memory_block_mib
            if memory > current.max_memory_mib:
                raise PlanError(f"the pod now needs {wanted.memory_mib} MiB of VM memory; in "
                                f"{memory_block_mib} MiB blocks that is {memory} MiB, more "
                                f"than the VM may grow to ({current.max_memory_mib} MiB)")
            notes.append(f"memory {current.memory_mib} -> {memory} MiB ("
                         f"{memory - current.memory_mib} MiB hot-plugged in "
                         f"{memory_block_mib} MiB blocks)")
        elif wanted.memory_mib < current.memory_mib:
            notes.append(f"memory stays {current.memory_mib} MiB: the pod needs "
                         f"{wanted.memory_mib} MiB now, but memory is never taken back "
                         f"from a running guest")
        if vcpus != current.vcpus:
            notes.append(f"vCPUs {current.vcpus} -> {vcpus}")
    limit = wanted.cgroup_memory_limit
    if limit > 0:  # the cgroup must hold the VM's real memory plus QEMU's overhead
        limit += (memory - wanted.memory_mib) * MIB
    plan = replace(wanted, vcpus=vcpus, memory_mib=memory, cgroup_memory_limit=limit,
                   explanation=wanted.explanation + tuple(notes))
    return PlanDelta(plan=plan, add_vcpus=max(0, vcpus - current.vcpus),
                     remove_vcpus=max(0, current.vcpus - vcpus),
                     add_memory_mib=max(0, memory - current.memory_mib), notes=tuple(notes))
