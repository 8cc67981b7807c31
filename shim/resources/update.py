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
- vCPUs beyond the VM's maximum: the plan is capped there (plan_sandbox), so an update
  asking for more gets the maximum and its CPU quota as asked, never a refusal.
- static mode (no hot-plug, confidential VMs): the VM keeps its boot size; a plan larger
  than it is refused with the numbers; anything within it is applied.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from fractions import Fraction
from typing import Mapping

from podvm_core.cpulist import format_cpu_list, union
from podvm_core.protocol import DEFAULT_CFS_PERIOD_US

from .model import MIB, ContainerResources, NoFit, PlanError, SandboxPlan

MEMORY_BLOCK_MIB = 128
"""Linux onlines hot-plugged memory in 128 MiB blocks on x86-64 (a smaller or unaligned
DIMM stays unusable and misaligns every later one): hot-plug in whole blocks."""


class StaticSizeExceeded(PlanError):
    """Growth beyond the boot size of a VM that cannot be hot-plugged (static mode).
    `fitting`: the part of the change that fits in the VM as it is (sandbox cgroup limits
    up to the boot size, cpuset), for the service to apply before answering
    FAILED_PRECONDITION; None when nothing was computed (e.g. the plan itself is refused)."""

    def __init__(self, message: str, fitting: "PlanDelta | None" = None) -> None:
        super().__init__(message)
        self.fitting = fitting


def pod_totals(sandbox: ContainerResources,
               containers: Mapping[str, ContainerResources]) -> ContainerResources:
    """What the pod uses in all: see the module's docstring."""
    cpus = max(_exact_cpus(sandbox), sum(map(_exact_cpus, containers.values()), Fraction(0)))
    shares = max(sandbox.cpu_shares, sum(max(c.cpu_shares, 0) for c in containers.values()))
    memory = max(sandbox.memory_limit,
                 sum(max(c.memory_limit, 0) for c in containers.values()))
    if cpus > 0:
        period = sandbox.cpu_period if _exact_cpus(sandbox) == cpus else DEFAULT_CFS_PERIOD_US
        quota = math.ceil(cpus * period)
    else:
        quota, period = sandbox.cpu_quota, sandbox.cpu_period
    return ContainerResources(cpu_quota=quota, cpu_period=period, cpu_shares=shares,
                              memory_limit=memory,
                              cpuset=cpuset_union(c.cpuset for c in containers.values()))


def _exact_cpus(c: ContainerResources) -> Fraction:
    """quota/period as a fraction: summed as floats, 100m + 200m come to 0.30000000000000004
    CPUs, a µs more quota than the pod cgroup (exactly the limits plus the overhead) allows."""
    return Fraction(c.cpu_quota, c.cpu_period) if c.quota_cpus else Fraction(0)


def cpuset_union(cpusets) -> str:
    """Kernel list syntax in, canonical kernel list syntax out; '' = no restriction."""
    return format_cpu_list(union(cpusets))


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
                memory_block_mib: int = MEMORY_BLOCK_MIB) -> PlanDelta:
    """`current`: the plan in force (what the VM has now); `boot`: the plan it booted
    with; `wanted`: the plan for the pod's new totals (from plan_sandbox). The delta never
    goes below the boot vCPUs, never removes memory, adds memory in whole
    `memory_block_mib` blocks. StaticSizeExceeded (static, with what fits attached) or
    NoFit (dynamic: the blocks exceed the VM's maximum or the pod cgroup) with numbers."""
    notes: list[str] = []
    if static:
        vcpus, memory = _static_size(current, boot, wanted, notes)
    else:
        vcpus, memory = _dynamic_size(current, boot, wanted, memory_block_mib, notes)
    limit = wanted.cgroup_memory_limit
    if limit > 0:  # the cgroup must hold the VM's real memory plus QEMU's overhead
        limit += (memory - wanted.memory_mib) * MIB
        if memory != wanted.memory_mib:
            notes.append(f"sandbox cgroup memory {limit // MIB} MiB = VM {memory} MiB + "
                         f"QEMU {limit // MIB - memory} MiB")
    plan = replace(wanted, vcpus=vcpus, memory_mib=memory, cgroup_memory_limit=limit,
                   explanation=wanted.explanation + tuple(notes))
    return PlanDelta(plan=plan, add_vcpus=max(0, vcpus - current.vcpus),
                     remove_vcpus=max(0, current.vcpus - vcpus),
                     add_memory_mib=max(0, memory - current.memory_mib), notes=tuple(notes))


def _static_size(current: SandboxPlan, boot: SandboxPlan, wanted: SandboxPlan,
                 notes: list[str]) -> tuple[int, int]:
    """Static mode: the VM's size as it is (vCPUs, MiB); StaticSizeExceeded when `wanted`
    needs more than the VM booted with."""
    vcpus, memory = current.vcpus, current.memory_mib
    over = []
    if wanted.vcpus > boot.vcpus:
        over.append(f"{wanted.vcpus} vCPUs (the VM has {boot.vcpus})")
    if wanted.memory_mib > boot.memory_mib:
        over.append(f"{wanted.memory_mib} MiB (the VM has {boot.memory_mib} MiB)")
    if over:
        fit = _fitting(current, boot, wanted)
        raise StaticSizeExceeded(
            f"the pod now needs {' and '.join(over)}, but static_sandbox_resource_mgmt "
            f"sizes the VM once at boot: no CPU or memory can be added; recreate the pod "
            f"with larger limits", fit)
    notes.append(f"static: the VM keeps its boot size, {vcpus} vCPUs and {memory} MiB "
                 f"(the pod needs {wanted.vcpus} and {wanted.memory_mib} MiB)")
    return vcpus, memory


def _dynamic_size(current: SandboxPlan, boot: SandboxPlan, wanted: SandboxPlan,
                  memory_block_mib: int, notes: list[str]) -> tuple[int, int]:
    """Dynamic mode: the VM's new size (vCPUs, MiB), never below the boot vCPUs nor the
    memory it has; NoFit when the blocks exceed its maximum or the pod cgroup."""
    vcpus = max(boot.vcpus, wanted.vcpus)
    memory = current.memory_mib
    if wanted.memory_mib > current.memory_mib:
        memory = _grown_memory(current, wanted, memory_block_mib, notes)
    elif wanted.memory_mib < current.memory_mib:
        notes.append(f"memory stays {current.memory_mib} MiB: the pod needs "
                     f"{wanted.memory_mib} MiB now, but memory is never taken back "
                     f"from a running guest")
    if vcpus > current.vcpus:
        notes.append(f"vCPUs {current.vcpus} -> {vcpus}: {vcpus - current.vcpus} "
                     f"hot-plugged")
    elif vcpus < current.vcpus:
        notes.append(f"vCPUs {current.vcpus} -> {vcpus}: {current.vcpus - vcpus} "
                     f"hot-added removed (the {boot.vcpus} boot vCPUs stay)")
    return vcpus, memory


def _grown_memory(current: SandboxPlan, wanted: SandboxPlan, memory_block_mib: int,
                  notes: list[str]) -> int:
    """The VM's memory grown to hold `wanted`'s in whole blocks (MiB)."""
    blocks = math.ceil((wanted.memory_mib - current.memory_mib) / memory_block_mib)
    memory = current.memory_mib + blocks * memory_block_mib
    if memory > current.max_memory_mib:
        raise NoFit(f"the pod now needs {wanted.memory_mib} MiB of VM memory; in "
                    f"{memory_block_mib} MiB blocks that is {memory} MiB, more "
                    f"than the VM may grow to ({current.max_memory_mib} MiB)")
    pod_cgroup = wanted.pod_cgroup_memory_mib
    if pod_cgroup and memory + wanted.vmm_overhead_mib > pod_cgroup:
        raise NoFit(f"the pod now needs {wanted.memory_mib} MiB of VM memory; in "
                    f"{memory_block_mib} MiB blocks that is {memory} MiB + "
                    f"{wanted.vmm_overhead_mib} MiB QEMU overhead = "
                    f"{memory + wanted.vmm_overhead_mib} MiB, but its pod cgroup "
                    f"allows {pod_cgroup} MiB: declare {memory_block_mib - 1} MiB "
                    f"more overhead in the RuntimeClass for hot-plug rounding")
    notes.append(f"memory {current.memory_mib} -> {memory} MiB ("
                 f"{memory - current.memory_mib} MiB hot-plugged as {blocks} "
                 f"{memory_block_mib} MiB blocks for the {wanted.memory_mib} MiB "
                 f"the pod needs)")
    return memory


def _fitting(current: SandboxPlan, boot: SandboxPlan, wanted: SandboxPlan) -> PlanDelta:
    """Static mode, `wanted` larger than the VM: the sandbox cgroup limits as far as the
    VM can use them (CPU quota up to its vCPUs, memory its own plus QEMU's) and the
    cpuset, with the VM's size unchanged."""
    quota = wanted.cgroup_cpu_quota
    if quota > 0:
        quota = min(quota, boot.vcpus * wanted.cgroup_cpu_period)
    limit = wanted.cgroup_memory_limit
    if limit > 0:
        limit = min(limit, (boot.memory_mib + wanted.vmm_overhead_mib) * MIB)
    note = (f"static: the VM keeps {boot.vcpus} vCPUs and {boot.memory_mib} MiB; what "
            f"fits in it: CPU quota " + (f"{quota}/{wanted.cgroup_cpu_period} µs" if quota > 0
                                        else "unlimited") +
            ", memory " + (f"{limit // MIB} MiB" if limit > 0 else "unlimited") +
            f", cpuset {wanted.cpuset or '(any)'}")
    plan = replace(wanted, vcpus=current.vcpus, memory_mib=current.memory_mib,
                   cgroup_cpu_quota=quota, cgroup_memory_limit=limit,
                   explanation=wanted.explanation + (note,))
    return PlanDelta(plan=plan, notes=(note,))
