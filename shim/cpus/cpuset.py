"""Host CPU sets: the kernel's list syntax, the CPUs a host has, which of them share a
core, and the pod's cpuset made from its containers' (docs/design.md, Pod totals and the delta).

The list syntax and the union of the containers' cpusets live in `podvm_core.cpulist`
(host and guest share the one, the resource model below this room uses the other); they
are re-exported here so that CPU code has one place to import from."""
from __future__ import annotations

import os
from typing import Iterable

from podvm_core.cpulist import format_cpu_list, parse_cpu_list, union

__all__ = ["format_cpu_list", "parse_cpu_list", "online_cpus", "union", "core_siblings"]

SYS_CPU = "/sys/devices/system/cpu"


def online_cpus(sys_cpu: str = SYS_CPU) -> frozenset[int]:
    """The CPUs the host has online. Not os.sched_getaffinity: that is this process's own
    mask, which the cgroup the shim started in may have narrowed."""
    with open(os.path.join(sys_cpu, "online")) as f:
        return parse_cpu_list(f.read(), "online CPUs")


def core_siblings(cpus: Iterable[int], sys_cpu: str = SYS_CPU) -> dict[int, frozenset[int]]:
    """CPU -> the CPUs of its physical core (SMT siblings, itself included). Where the
    kernel does not say, a CPU is its own core. Exclusive CPUs are handed out by whole
    cores when they can be: a neighbour on the sibling thread shares the core's
    execution units and caches with the pod that was promised the CPU."""
    siblings: dict[int, frozenset[int]] = {}
    for cpu in cpus:
        path = os.path.join(sys_cpu, f"cpu{cpu}", "topology", "thread_siblings_list")
        try:
            with open(path) as f:
                siblings[cpu] = parse_cpu_list(f.read()) | {cpu}
        except (OSError, ValueError):
            siblings[cpu] = frozenset({cpu})
    return siblings
