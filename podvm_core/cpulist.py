"""The kernel's CPU-list syntax (`0-3,8,10-11`), as cgroup cpuset files, sysfs and OCI
specs write it."""
from __future__ import annotations

import re
from typing import Iterable

MAX_CPU_INDEX = 8191  # the kernel's NR_CPUS upper bound
_RANGE = re.compile(r"([0-9]+)(?:-([0-9]+))?")


class CpuListError(ValueError):
    """Text that is not a CPU list."""


def parse_cpu_list(text: str, what: str = "cpu list") -> frozenset[int]:
    """The CPUs `text` names; empty text names none. `what` says where it came from."""
    text = text.strip()
    if not text:
        return frozenset()
    items: set[int] = set()
    for part in text.split(","):
        match = _RANGE.fullmatch(part)
        if match is None:
            raise CpuListError(f"{what} {text!r}: {part!r} is not N or N-M")
        lo = int(match.group(1))
        hi = int(match.group(2)) if match.group(2) is not None else lo
        if lo > hi or hi > MAX_CPU_INDEX:
            raise CpuListError(f"{what} {text!r}: bad range {part!r}")
        items.update(range(lo, hi + 1))
    return frozenset(items)


def format_cpu_list(items: Iterable[int]) -> str:
    """Canonical form, as the kernel prints it back."""
    ordered = sorted(set(items))
    runs: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        runs.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(runs)


def union(cpusets: Iterable[str]) -> frozenset[int]:
    """The sandbox's cpuset: every CPU one of its containers may use; empty: no
    restriction. A container without a cpuset adds nothing instead of lifting the
    restriction: the sandbox container never has one, while under kubelet's static CPU
    manager every workload container does (exclusive CPUs or the shared pool)."""
    cpus: set[int] = set()
    for text in cpusets:
        cpus |= parse_cpu_list(text or "", "cpuset")
    return frozenset(cpus)
