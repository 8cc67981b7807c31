"""Where each vCPU thread may run, and which vCPUs a container may use inside the guest.
Pure but for `apply`.

Pinning (`enable_vcpus_pinning`): when the VM has as many online vCPUs as the pod's
cpuset has CPUs, vCPU i runs on the i-th CPU of the set and nowhere else; otherwise every
vCPU floats over the whole set. With vCPUs pinned, a container whose host cpuset is a
part of the pod's is confined in the guest to the vCPUs pinned on its CPUs, so
containers with disjoint cpusets never share a vCPU (kata-containers#5050)."""
from __future__ import annotations

import logging
import os
from typing import Iterable, Mapping, Sequence

log = logging.getLogger("podvm.cpus")


def pin_map(vcpu_threads: Sequence[int], online: int, cpuset: Iterable[int],
            enabled: bool) -> dict[int, frozenset[int]]:
    """Thread id -> the CPUs it may run on. `vcpu_threads` are in vCPU index order; the
    first `online` of them are the vCPUs the guest uses (the others are offline and
    asleep). An empty cpuset: no restriction, nothing to set."""
    cpus = sorted(set(cpuset))
    if not cpus:
        return {}
    whole = frozenset(cpus)
    pins = {tid: whole for tid in vcpu_threads}
    if enabled and online == len(cpus):
        for tid, cpu in zip(vcpu_threads[:online], cpus):
            pins[tid] = frozenset({cpu})
    return pins


def guest_cpus(host_cpuset: Iterable[int], vcpu_pins: Sequence[frozenset[int]]) -> list[int]:
    """The guest vCPU indexes a container with `host_cpuset` may use: those pinned to one
    of its host CPUs. [] when none is (nothing pinned, or no overlap): no confinement."""
    wanted = set(host_cpuset)
    return [i for i, allowed in enumerate(vcpu_pins)
            if len(allowed) == 1 and allowed <= wanted]


def apply(pins: Mapping[int, frozenset[int]]) -> dict[int, frozenset[int]]:
    """sched_setaffinity for each thread; threads that exited meanwhile are skipped. The
    affinities as the kernel then reports them."""
    seen = {}
    for tid, cpus in pins.items():
        try:
            os.sched_setaffinity(tid, cpus)
            seen[tid] = frozenset(os.sched_getaffinity(tid))
        except ProcessLookupError:
            continue
        except OSError as exc:
            log.warning("affinity of thread %d to %s: %s", tid, sorted(cpus), exc)
    return seen
