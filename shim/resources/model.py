"""Sizing rules (docs/design.md, Sizing rules), each one explained in the plan it produces.

- vCPUs = ceil(default_vcpus + quota/period); with no quota (quota <= 0 or period <= 0,
  as with the static CPU manager or CFS quota disabled), ceil(default_vcpus + shares/1024)
  where shares above the minimum (2, BestEffort) count.
- memory = default_memory + the memory limit (MiB, rounded up): `default_*` is the guest's
  own share, so the RuntimeClass overhead podvm reports makes Kubernetes' view equal the VM.
- no limits at all: the defaults.
- sizing "max": max(default, workload) instead of the sum.
- vCPUs are capped at the most the VM may have (`default_maxvcpus`, or the host's CPUs):
  CPU is compressible, and the sandbox cgroup's quota, which stays what the pod asked,
  enforces its limit; a pod Kubernetes admitted runs (Kata clamps the same way). Memory is
  not compressible: a pod whose memory cannot fit is refused.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from podvm_core.protocol import DEFAULT_CFS_PERIOD_US

from ..config import Config

MIB = 1 << 20
MIN_SHARES = 2
DEFAULT_PERIOD_US = DEFAULT_CFS_PERIOD_US


class PlanError(ValueError):
    """Inputs the model cannot use (a malformed or disallowed annotation)."""


class NoFit(PlanError):
    """A plan larger than what it must fit in: the message names the resource and numbers."""


@dataclass(frozen=True)
class ContainerResources:
    """What one container (or the whole pod, from the sandbox annotations) asks for."""

    cpu_quota: int = 0
    cpu_period: int = 0
    cpu_shares: int = 0
    memory_limit: int = 0
    """Bytes; 0 = no limit."""
    cpuset: str = ""

    @property
    def quota_cpus(self) -> float:
        if self.cpu_quota > 0 and self.cpu_period > 0:
            return self.cpu_quota / self.cpu_period
        return 0.0

    @property
    def share_cpus(self) -> float:
        return self.cpu_shares / 1024 if self.cpu_shares > MIN_SHARES else 0.0


@dataclass(frozen=True)
class Host:
    cpus: int
    memory_mib: int


@dataclass(frozen=True)
class SandboxRequest:
    """Everything the plan depends on, already parsed and validated."""

    pod: ContainerResources
    """The pod's totals: the sandbox annotations, or the sum of its containers."""
    default_vcpus: int
    default_memory_mib: int
    max_vcpus: int
    """0 = the host's."""
    max_memory_mib: int
    """0 = the host's."""
    sizing: str = "sum"
    memory_overhead_mib: int = 0
    """Host memory QEMU itself takes beyond guest RAM (measured)."""
    pod_cgroup_memory_mib: int = 0
    """The memory limit kubelet gave the pod cgroup (its containers' limits plus the
    RuntimeClass overhead); 0 = none."""
    pod_cgroup_cpus: float = 0.0
    """The pod cgroup's CPU quota in CPUs; 0 = none."""


@dataclass(frozen=True)
class SandboxPlan:
    vcpus: int
    memory_mib: int
    max_vcpus: int
    max_memory_mib: int
    cgroup_cpu_quota: int
    """µs per period for the sandbox cgroup; -1 = unlimited."""
    cgroup_cpu_period: int
    cgroup_cpu_shares: int
    cgroup_memory_limit: int
    """Bytes; -1 = unlimited."""
    cpuset: str
    overhead_memory_mib: int
    """What the RuntimeClass should declare as overhead.podFixed.memory."""
    overhead_cpu_millis: int
    workload_cpus: float = 0.0
    """What the pod's containers ask for (its limits; shares without a quota): with the
    overhead, Kubernetes' view of the pod."""
    workload_memory_mib: int = 0
    vmm_overhead_mib: int = 0
    """Host memory QEMU takes beyond guest RAM (in the sandbox cgroup's memory limit)."""
    pod_cgroup_memory_mib: int = 0
    """The pod cgroup's memory limit the plan was checked against; 0 = none. A running
    pod's growth is checked against it too (plan_update)."""
    uncapped_vcpus: int = 0
    """The vCPUs the sizing rules give before the cap at `max_vcpus`: more than `vcpus`
    when the pod was capped."""
    disk_mib: int = 0
    """The pod's scratch disk (shim/resources/storage.py, scratch_disk_mib); 0 = none."""
    explanation: tuple[str, ...] = field(default=(), compare=False)


def plan_sandbox(req: SandboxRequest, host: Host) -> SandboxPlan:
    """The plan for a pod's totals; NoFit (numbers in the message) when it cannot fit in
    the host, the configured maxima or the pod cgroup. Every number is explained."""
    why: list[str] = []
    pod = req.pod
    workload_cpus, workload_mib = _workload(pod, why)
    vcpus, memory = _vm_size(req, workload_cpus, workload_mib, why)
    max_vcpus = req.max_vcpus or host.cpus
    max_memory = req.max_memory_mib or host.memory_mib
    vcpu_bound = 'default_maxvcpus' if req.max_vcpus else 'the host CPUs'
    why.append(f"at most {max_vcpus} vCPUs ({vcpu_bound}) and {max_memory} MiB ("
               f"{'default_maxmemory' if req.max_memory_mib else 'the host memory'})")
    uncapped_vcpus = vcpus
    if vcpus > max_vcpus:
        vcpus = max_vcpus
        why.append(f"vCPUs capped at {max_vcpus} ({vcpu_bound}) instead of "
                   f"{uncapped_vcpus}: CPU is compressible, and the sandbox cgroup's quota, "
                   f"left as the pod asked, enforces its CPU limit")
    _check_memory_fits(req, host, memory, max_memory, workload_mib)
    quota, period, shares, overhead_cpu = _cpu_limits(req, why)
    overhead_memory = memory - workload_mib + req.memory_overhead_mib
    memory_limit = (memory + req.memory_overhead_mib) * MIB if workload_mib else -1
    if memory_limit > 0:
        why.append(f"sandbox cgroup memory {memory + req.memory_overhead_mib} MiB = VM "
                   f"{memory} MiB + QEMU {req.memory_overhead_mib} MiB")
    else:
        why.append("sandbox cgroup memory unlimited: the pod has no memory limit (the VM "
                   f"still has only {memory} MiB)")
    why.append(f"cpuset {pod.cpuset}: the union of the containers' cpusets" if pod.cpuset
               else "no cpuset: the vCPUs may run on any CPU the pod cgroup allows")
    why.append(f"RuntimeClass overhead.podFixed: memory {overhead_memory}Mi = VM "
               f"{memory} - workload {workload_mib} + QEMU {req.memory_overhead_mib}, "
               f"cpu {overhead_cpu}m = " + (f"{req.default_vcpus} default vCPUs"
                                            if overhead_cpu else "none (sizing max)"))
    return SandboxPlan(vcpus=vcpus, memory_mib=memory, max_vcpus=max_vcpus,
                       max_memory_mib=max_memory, cgroup_cpu_quota=quota,
                       cgroup_cpu_period=period, cgroup_cpu_shares=shares,
                       cgroup_memory_limit=memory_limit, cpuset=pod.cpuset,
                       overhead_memory_mib=overhead_memory, overhead_cpu_millis=overhead_cpu,
                       workload_cpus=round(workload_cpus, 3), workload_memory_mib=workload_mib,
                       vmm_overhead_mib=req.memory_overhead_mib,
                       pod_cgroup_memory_mib=req.pod_cgroup_memory_mib,
                       uncapped_vcpus=uncapped_vcpus, explanation=tuple(why))


def _workload(pod: ContainerResources, why: list[str]) -> tuple[float, int]:
    """What the pod's containers ask for: CPUs (its quota, else its shares) and MiB."""
    if pod.quota_cpus:
        workload_cpus = pod.quota_cpus
        why.append(f"workload CPUs {workload_cpus:g} = quota {pod.cpu_quota} / period "
                   f"{pod.cpu_period}")
    elif pod.share_cpus:
        workload_cpus = pod.share_cpus
        why.append(f"workload CPUs {workload_cpus:g} = shares {pod.cpu_shares} / 1024 "
                   f"(no CFS quota: quota {pod.cpu_quota}, period {pod.cpu_period})")
    else:
        workload_cpus = 0.0
        why.append("no CPU limit or request: the default vCPUs alone")
    workload_mib = math.ceil(pod.memory_limit / MIB) if pod.memory_limit > 0 else 0
    why.append(f"workload memory {workload_mib} MiB = limit {pod.memory_limit} bytes" if
               workload_mib else "no memory limit: the default memory alone")
    return workload_cpus, workload_mib


def _vm_size(req: SandboxRequest, workload_cpus: float, workload_mib: int,
             why: list[str]) -> tuple[int, int]:
    """vCPUs and MiB by the sizing rule, before any cap."""
    if req.sizing == "max":
        vcpus = max(req.default_vcpus, math.ceil(workload_cpus))
        memory = max(req.default_memory_mib, workload_mib)
        why.append(f"sizing max: vCPUs max({req.default_vcpus}, {math.ceil(workload_cpus)}) "
                   f"= {vcpus}, memory max({req.default_memory_mib}, {workload_mib}) = "
                   f"{memory} MiB")
    else:
        vcpus = math.ceil(req.default_vcpus + workload_cpus)
        memory = req.default_memory_mib + workload_mib
        why.append(f"vCPUs ceil({req.default_vcpus} + {workload_cpus:g}) = {vcpus}; memory "
                   f"{req.default_memory_mib} + {workload_mib} = {memory} MiB")
    return vcpus, memory


def _check_memory_fits(req: SandboxRequest, host: Host, memory: int, max_memory: int,
                       workload_mib: int) -> None:
    """NoFit when the VM's memory (and QEMU's) exceeds the maximum, the host or the pod
    cgroup: memory is not compressible."""
    if memory > max_memory:
        raise NoFit(f"the pod needs {memory} MiB of VM memory but at most {max_memory} MiB "
                    f"are allowed ({'default_maxmemory' if req.max_memory_mib else 'host memory'})")
    if memory + req.memory_overhead_mib > host.memory_mib:
        raise NoFit(f"the pod needs {memory} MiB + {req.memory_overhead_mib} MiB QEMU "
                    f"overhead but the host has {host.memory_mib} MiB")
    if req.pod_cgroup_memory_mib and memory + req.memory_overhead_mib > \
            req.pod_cgroup_memory_mib:
        raise NoFit(f"the pod needs {memory} MiB of VM memory + {req.memory_overhead_mib} MiB "
                    f"QEMU overhead = {memory + req.memory_overhead_mib} MiB, but its pod "
                    f"cgroup allows {req.pod_cgroup_memory_mib} MiB: declare the overhead in "
                    f"the RuntimeClass (overhead.podFixed.memory >= "
                    f"{memory - workload_mib + req.memory_overhead_mib}Mi)")


def _cpu_limits(req: SandboxRequest, why: list[str]) -> tuple[int, int, int, int]:
    """The sandbox cgroup's CPU quota, period and shares, and the guest's CPU overhead
    in millicores; NoFit when the quota exceeds the pod cgroup's."""
    pod = req.pod
    period = pod.cpu_period if pod.cpu_quota > 0 and pod.cpu_period > 0 else DEFAULT_PERIOD_US
    overhead_cpu = req.default_vcpus * 1000 if req.sizing != "max" else 0
    if pod.quota_cpus:
        # in whole µs: ceil((quota / period + n) * period) in floats is often a µs more
        # than a pod cgroup holding exactly the workload and the declared overhead allows
        quota = pod.cpu_quota + overhead_cpu * period // 1000
        why.append(f"sandbox cgroup CPU quota {quota}/{period} µs = (workload "
                   f"{pod.quota_cpus:g} + {overhead_cpu}m for the guest) x period")
    else:
        quota = -1
        why.append(f"sandbox cgroup CPU quota unlimited (period {period} µs): the pod has "
                   f"no CPU limit")
    if req.pod_cgroup_cpus and quota > 0 and quota / period > req.pod_cgroup_cpus + 1e-9:
        raise NoFit(f"the pod's sandbox needs a CPU quota of {quota / period:g} CPUs "
                    f"(workload + {overhead_cpu}m for the guest), but its pod cgroup allows "
                    f"{req.pod_cgroup_cpus:g}: declare the overhead in the RuntimeClass "
                    f"(overhead.podFixed.cpu >= {overhead_cpu}m)")
    shares = max(MIN_SHARES, pod.cpu_shares + overhead_cpu * 1024 // 1000) \
        if pod.cpu_shares else 1024
    why.append(f"sandbox cgroup CPU shares {shares} = " + (
        f"{pod.cpu_shares} + {overhead_cpu * 1024 // 1000} for the overhead" if pod.cpu_shares
        else "the default weight (the pod has no CPU request)"))
    return quota, period, shares, overhead_cpu


def request_from_config(config: Config, pod: ContainerResources) -> SandboxRequest:
    q = config.qemu
    return SandboxRequest(pod=pod, default_vcpus=q.default_vcpus,
                          default_memory_mib=q.default_memory, max_vcpus=q.default_maxvcpus,
                          max_memory_mib=q.default_maxmemory, sizing=config.runtime.sizing,
                          memory_overhead_mib=q.vmm_overhead_mib)


def from_linux_resources(resources: dict) -> ContainerResources:
    """An OCI LinuxResources object (what a container without a pod asks for)."""
    cpu = resources.get("cpu") or {}
    memory = resources.get("memory") or {}
    return ContainerResources(cpu_quota=int(cpu.get("quota") or 0),
                              cpu_period=int(cpu.get("period") or 0),
                              cpu_shares=int(cpu.get("shares") or 0),
                              memory_limit=max(0, int(memory.get("limit") or 0)),
                              cpuset=str(cpu.get("cpus") or ""))
