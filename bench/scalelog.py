"""containerd's log (the shims' lines included) as bench/scale.py reads it: where a pod's
start and its removal went, and each `shim delete` containerd ran, killed or saw fail. Each
line is told by its pod's ids: with runc's pods run right after podvm's, a podvm delete may
end in runc's time. Lines as containerd 1.6 writes them (runtime/v2/shim.go, binary.go)."""
from __future__ import annotations

import re
import statistics
from collections import Counter
from dataclasses import dataclass, field

from bench.pod_bench import phases
from bench.scalepods import PodRun

KILLED_DELETE = 'msg="failed to delete" '
"""containerd's line for a `shim delete` that failed or that it killed at its limit (its
cmd field names the task's id)."""
DELETE_BEGINS = 'msg="cleaning up after shim disconnected" '
"""containerd's line (with the task's id) as it runs a `shim delete` for a task whose shim
connection closed."""
DELETE_LINE = re.compile(r"shim delete of (\S+) done in ([0-9.]+)s, ([0-9.]+)s since exec")
"""The line shim/contract/delete.py writes (containerd logs it as its stderr)."""
PAST_DEADLINE = re.compile(r"task\.v2\.Task/(\w+) answered DEADLINE_EXCEEDED")
"""The shim's line for a Task API call it answered at the call's deadline."""
REMOVAL = ("containers stopped, to the shim stopping the VM",
           "the VM's stop to StopPodSandbox's return", "RemovePodSandbox")
"""A podvm pod's removal, in turn: what the shim waits on the guest for, then the host's."""


@dataclass
class Deletes:
    runs: int = 0
    """How many `shim delete`s containerd ran for the pods (written or not)."""
    written: list[tuple[float, float, float]] = field(default_factory=list)
    """Each that wrote its line: shim_deletes."""
    failed: list[str] = field(default_factory=list)
    """containerd's lines for those it killed or saw fail."""


def stamp(line: str) -> float:
    """Seconds of the day of containerd's time="...Z" at the start of `line`."""
    hms = line.split('"', 2)[1].split("T", 1)[1].rstrip("Z")
    h, m, sec = hms.split(":")
    return int(h) * 3600 + int(m) * 60 + float(sec)


def ids_of(pods: list[PodRun]) -> set[str]:
    return {i for p in pods for i in p.ids}


def shim_deletes(log: str, pods: list[PodRun]) -> list[tuple[float, float, float]]:
    """Each of the pods' `shim delete` runs that wrote its line: (seconds in its cleanup,
    since its exec, and from containerd's DELETE_BEGINS line to its own in containerd's
    log: what containerd's 5 s limit counts). A delete containerd killed writes none."""
    ids = ids_of(pods)
    began: dict[str, float] = {}
    found = []
    for line in log.splitlines():
        if DELETE_BEGINS in line:
            ident = re.search(r" id=(\S+)", line)
            if ident:
                began[ident.group(1)] = stamp(line)
        elif (m := DELETE_LINE.search(line)) and m.group(1) in ids:
            start = began.pop(m.group(1), None)
            found.append((float(m.group(2)), float(m.group(3)),
                          stamp(line) - start if start is not None else float("nan")))
    return found


def read_deletes(pods: list[PodRun], log: str) -> Deletes:
    """The `shim delete`s containerd ran for `pods`, from its log since they started."""
    ids = ids_of(pods)
    named = [line for line in log.splitlines() if (DELETE_BEGINS in line or KILLED_DELETE
                                                   in line) and any(i in line for i in ids)]
    return Deletes(sum(1 for line in named if DELETE_BEGINS in line),
                   shim_deletes(log, pods),
                   [line.strip()[:400] for line in named if KILLED_DELETE in line])


def unattributed_failures(log: str, pods: list[PodRun]) -> list[str]:
    """containerd's "failed to delete" lines that name none of `pods` (any such failure
    fails the bench too)."""
    ids = ids_of(pods)
    return [line.strip()[:400] for line in log.splitlines()
            if KILLED_DELETE in line and not any(i in line for i in ids)]


def pod_phases(log_lines: list[str], pod: PodRun) -> list[float]:
    """bench/pod_bench.py's phases of one pod, timed from its own RunPodSandbox line (with
    twenty pods at once, the latest call before its shim's first line may be another's)."""
    own = [ln for ln in log_lines if pod.pod_id in ln or
           ("RunPodSandbox for" in ln and f"Name:{pod.name}," in ln)]
    return phases("\n".join(own), pod.pod_id)


def removal_phases(log_lines: list[str], pod_id: str) -> list[float]:
    """Seconds in each of REMOVAL for one podvm pod; [] when a line is missing."""
    own = [ln for ln in log_lines if pod_id in ln]
    needles = (f'msg="StopPodSandbox for \\"{pod_id}\\""', "stopping the VM",
               f'StopPodSandbox for \\"{pod_id}\\" returns',
               f'RemovePodSandbox \\"{pod_id}\\" returns')
    marks = [next((stamp(ln) for ln in own if needle in ln), None) for needle in needles]
    if None in marks:
        return []
    return [b - a for a, b in zip(marks, marks[1:])]


def past_deadline(log_lines: list[str], pods: list[PodRun]) -> Counter:
    """The pods' Task API calls their shims answered at the deadline, by method."""
    ids = ids_of(pods)
    return Counter(m.group(1) for ln in log_lines if (m := PAST_DEADLINE.search(ln))
                   and any(i in ln for i in ids))


def removal_medians(log_lines: list[str], pods: list[PodRun]) -> dict[str, float]:
    spent = [s for p in pods if p.pod_id and (s := removal_phases(log_lines, p.pod_id))]
    return {name: statistics.median(s[k] for s in spent)
            for k, name in enumerate(REMOVAL)} if spent else {}


def template_use(log: str, pods: list[PodRun]) -> tuple[int, list[str]]:
    """How many of the pods restored a template, and the templates made during the run
    (shim/vm/template/template.py's lines)."""
    restored = sum(1 for p in pods if p.pod_id and
                   f"sandbox {p.pod_id}: VM restored from template" in log)
    made = re.findall(r"template (\w+) made by sandbox \w+ in ([0-9.]+s)", log)
    return restored, [f"{key[:8]} in {took}" for key, took in made]
