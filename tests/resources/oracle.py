"""The sizing rules of shim/resources/model.py's and update.py's docstrings, written again
with exact arithmetic and without the model's code: the size a pod must get, and whether
(and why) its plan must be refused.

The property tests compare the model with this both ways: a plan the rules admit must be
planned, one they refuse must be refused with a message naming the reason. A model that
refused every plan (or none) therefore fails them instead of passing vacuously.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

from shim.resources import ContainerResources, Host, SandboxPlan, SandboxRequest

MIB = 1 << 20
MIN_SHARES = 2
DEFAULT_PERIOD_US = 100_000
BLOCK_MIB = 128

Reason = tuple[str, ...]
"""Phrases a refusal's message must all contain (the resource and its numbers)."""


@dataclass(frozen=True)
class Expected:
    """What the rules say of one request: the VM's size, the sandbox cgroup's CPU quota,
    and every reason to refuse it (empty: it must be planned)."""

    vcpus: int
    """Capped at the VM's maximum (the host's CPUs or default_maxvcpus)."""
    uncapped_vcpus: int
    memory_mib: int
    workload_mib: int
    cgroup_cpu_quota: int
    """µs per period; -1 = unlimited (the pod has no CPU limit)."""
    cgroup_cpu_period: int
    reasons: tuple[Reason, ...]

    @property
    def refused(self) -> bool:
        return bool(self.reasons)


def workload_cpus(pod: ContainerResources) -> Fraction:
    """quota/period; with no CFS quota, shares/1024 above BestEffort's 2; else none."""
    if pod.cpu_quota > 0 and pod.cpu_period > 0:
        return Fraction(pod.cpu_quota, pod.cpu_period)
    if pod.cpu_shares > MIN_SHARES:
        return Fraction(pod.cpu_shares, 1024)
    return Fraction(0)


def workload_mib(pod: ContainerResources) -> int:
    """The memory limit in MiB, rounded up; 0 = no limit."""
    return -(-pod.memory_limit // MIB) if pod.memory_limit > 0 else 0


def expected_plan(req: SandboxRequest, host: Host) -> Expected:
    """The rules for `plan_sandbox(req, host)`."""
    cpus, mib = workload_cpus(req.pod), workload_mib(req.pod)
    if req.sizing == "max":
        vcpus = max(req.default_vcpus, math.ceil(cpus))
        memory = max(req.default_memory_mib, mib)
        guest_cpus = 0
    else:
        vcpus = math.ceil(req.default_vcpus + cpus)
        memory = req.default_memory_mib + mib
        guest_cpus = req.default_vcpus
    with_qemu = memory + req.memory_overhead_mib
    reasons: list[Reason] = []
    # CPU is compressible: more vCPUs than the VM may have is never a reason to refuse
    max_vcpus = req.max_vcpus or host.cpus
    max_memory = req.max_memory_mib or host.memory_mib
    if memory > max_memory:
        reasons.append((f"{memory} MiB", f"at most {max_memory} MiB",
                        "default_maxmemory" if req.max_memory_mib else "host memory"))
    if with_qemu > host.memory_mib:
        reasons.append((f"{req.memory_overhead_mib} MiB QEMU overhead",
                        f"host has {host.memory_mib} MiB"))
    if req.pod_cgroup_memory_mib and with_qemu > req.pod_cgroup_memory_mib:
        reasons.append((f"= {with_qemu} MiB", f"pod cgroup allows {req.pod_cgroup_memory_mib} MiB",
                        f"overhead.podFixed.memory >= {with_qemu - mib}Mi"))
    quota_based = req.pod.cpu_quota > 0 and req.pod.cpu_period > 0
    period = req.pod.cpu_period if quota_based else DEFAULT_PERIOD_US
    quota = req.pod.cpu_quota + guest_cpus * period if quota_based else -1
    # kubelet's quota/period arrives as a float: a nano-CPU of slack absorbs its rounding
    if req.pod_cgroup_cpus and quota > 0 and \
            Fraction(quota, period) > Fraction(req.pod_cgroup_cpus) + Fraction(1, 10**9):
        reasons.append(("pod cgroup allows", f"overhead.podFixed.cpu >= {guest_cpus * 1000}m"))
    return Expected(vcpus=min(vcpus, max_vcpus), uncapped_vcpus=vcpus, memory_mib=memory,
                    workload_mib=mib, cgroup_cpu_quota=quota, cgroup_cpu_period=period,
                    reasons=tuple(reasons))


def expected_update(current: SandboxPlan, boot: SandboxPlan, wanted: Expected, static: bool,
                    vmm_overhead_mib: int, pod_cgroup_memory_mib: int = 0) -> tuple[Reason, ...]:
    """Why `plan_update` must refuse the step from `current` to `wanted` (a plan the rules
    admit); empty: it must be applied."""
    if static:  # the VM keeps its boot size: nothing may be added
        over = []
        if wanted.vcpus > boot.vcpus:
            over.append(f"{wanted.vcpus} vCPUs (the VM has {boot.vcpus})")
        if wanted.memory_mib > boot.memory_mib:
            over.append(f"{wanted.memory_mib} MiB (the VM has {boot.memory_mib} MiB)")
        return (tuple(over) + ("static_sandbox_resource_mgmt",),) if over else ()
    if wanted.memory_mib <= current.memory_mib:  # memory is never taken back
        return ()
    blocks = -(-(wanted.memory_mib - current.memory_mib) // BLOCK_MIB)
    memory = current.memory_mib + blocks * BLOCK_MIB
    reasons: list[Reason] = []
    if memory > current.max_memory_mib:
        reasons.append((f"that is {memory} MiB", f"grow to ({current.max_memory_mib} MiB)"))
    if pod_cgroup_memory_mib and memory + vmm_overhead_mib > pod_cgroup_memory_mib:
        reasons.append((f"= {memory + vmm_overhead_mib} MiB",
                        f"pod cgroup allows {pod_cgroup_memory_mib} MiB"))
    return tuple(reasons)


def names_a_reason(message: str, reasons: tuple[Reason, ...]) -> bool:
    """Whether a refusal's message gives one of the reasons, with its numbers."""
    return any(all(phrase in message for phrase in reason) for reason in reasons)


def assert_refusal_expected(message: str, reasons: tuple[Reason, ...]) -> None:
    """A refusal the rules call for, naming one of their reasons."""
    assert reasons, f"refused, but the rules admit it: {message}"
    assert names_a_reason(message, reasons), f"{message!r} names none of {reasons}"


def assert_admission_expected(reasons: tuple[Reason, ...]) -> None:
    """A plan the rules admit."""
    assert not reasons, f"planned, but the rules refuse it: {reasons}"
