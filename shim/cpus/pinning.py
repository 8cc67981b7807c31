"""Where each vCPU thread may run, and which vCPUs a container may use inside the guest
(docs/design.md, CPUs: pinning and exclusive CPUs). Pure but for `apply`.

Pinning (`enable_vcpus_pinning`): when the VM has as many online vCPUs as the pod's
cpuset has CPUs, vCPU i runs on the i-th CPU of the set and nowhere else; otherwise every
vCPU floats over the whole set. With vCPUs pinned, a container whose host cpuset is a
part of the pod's is confined in the guest to the vCPUs pinned on its CPUs, so
containers with disjoint cpusets never share a vCPU (kata-containers#5050, which Kata
cannot do: it pins, but runs every container on every vCPU)."""
from __future__ import annotations

import logging
import os
from typing import Iterable, Mapping, Sequence

log = logging.getLogger("podvm.cpus")


def pin_map(vcpu_threads: Sequence[int], online: int, cpuset: Iterable[int],
            enabled: bool, everywhere: Iterable[int] = ()) -> dict[int, frozenset[int]]:
    """Thread id -> the CPUs it may run on. `vcpu_threads` are in vCPU index order; the
    first `online` of them are the vCPUs the guest uses (the others are offline and
    asleep, and float). An empty cpuset means no restriction: the threads float over
    `everywhere` (the host's CPUs), because an affinity set earlier outlives a wider
    cpuset and must be widened explicitly; nothing is set when that is empty too."""
    wanted = sorted(set(cpuset))
    cpus = wanted or sorted(set(everywhere))
    if not cpus:
        return {}
    whole = frozenset(cpus)
    pins = {tid: whole for tid in vcpu_threads}
    if enabled and wanted and online == len(wanted):
        for tid, cpu in zip(vcpu_threads[:online], cpus):
            pins[tid] = frozenset({cpu})
    return pins


def vcpus_by_host_cpu(vcpu_pins: Sequence[frozenset[int]]) -> dict[int, list[int]]:
    """Host CPU -> the guest vCPU indexes pinned on it alone (floating vCPUs are on no
    CPU in particular and appear nowhere)."""
    found: dict[int, list[int]] = {}
    for index, allowed in enumerate(vcpu_pins):
        if len(allowed) == 1:
            found.setdefault(next(iter(allowed)), []).append(index)
    return found


def guest_cpus(host_cpuset: Iterable[int], vcpu_pins: Sequence[frozenset[int]]) -> list[int]:
    """The guest vCPU indexes a container with `host_cpuset` may use: those pinned on one
    of its host CPUs. [] when none is (nothing pinned, or no overlap): no confinement,
    the container may use every online vCPU, as it would run anywhere in the pod's set
    on the host."""
    by_cpu = vcpus_by_host_cpu(vcpu_pins)
    return sorted(i for cpu in set(host_cpuset) for i in by_cpu.get(cpu, ()))


def guest_cpus_for_update(host_cpuset: Iterable[int],
                          vcpu_pins: Sequence[frozenset[int]]) -> list[int]:
    """The vCPUs to send in an update: those of `guest_cpus`, or every online vCPU when
    none maps. runc update keeps an absent cpuset as it was, so a container confined
    before and no longer (its pins changed, or floated) must be told every vCPU."""
    return guest_cpus(host_cpuset, vcpu_pins) or list(range(len(vcpu_pins)))


def apply(pins: Mapping[int, frozenset[int]], owner: int = 0) -> dict[int, frozenset[int]]:
    """sched_setaffinity for each thread; threads that exited meanwhile (a vCPU unplugged)
    are skipped, and a mask the thread's cpuset refuses is logged, not raised: a re-pin is
    a best effort that the next change repeats. The affinities as the kernel then reports
    them. `owner`: the process the threads are of (QEMU, whose ids were checked when
    they were asked for); one no longer its own just before its affinity is set (the
    thread ended, its id perhaps another process's now) is skipped as exited."""
    seen = {}
    for tid, cpus in pins.items():
        if owner and not os.path.exists(f"/proc/{owner}/task/{tid}"):
            continue
        try:
            os.sched_setaffinity(tid, cpus)
            seen[tid] = frozenset(os.sched_getaffinity(tid))
        except ProcessLookupError:
            continue
        except OSError as exc:
            log.warning("affinity of thread %d to CPUs %s: %s", tid, sorted(cpus), exc)
    return seen
