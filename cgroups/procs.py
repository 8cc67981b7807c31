"""What the kernel says about a process's threads: which exist and which cgroup each one
is in. The source of truth for placement, since threads come and go under us.

Read from /proc with the standard library, not psutil: this package also runs inside a
guest that has nothing else (tests/cgroups/guest_v2_check.py)."""
from __future__ import annotations

import os

from .errors import ProcessGone

UNIFIED = "unified"
"""The key of the cgroup2 hierarchy in a thread's cgroup map (its line is `0::/path`)."""


def thread_ids(pid: int) -> list[int]:
    try:  # psutil's threads() would also read every thread's stat, every second (watch)
        return sorted(int(name) for name in os.listdir(f"/proc/{pid}/task"))
    except FileNotFoundError:
        raise ProcessGone(f"process {pid} has exited (no /proc/{pid}/task)") from None


def parse_proc_cgroup(text: str) -> dict[str, str]:
    """Lines `id:controllers:path` -> controller (or `name=...`, or UNIFIED for cgroup2) ->
    path; co-mounted v1 controllers each get the shared path."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if not controllers:
            out[UNIFIED] = path
            continue
        for name in controllers.split(","):
            out[name] = path
    return out


def thread_cgroups(pid: int, tid: int) -> dict[str, str] | None:
    """None when the thread has exited."""
    try:  # psutil has no per-thread cgroup membership
        with open(f"/proc/{pid}/task/{tid}/cgroup") as f:
            return parse_proc_cgroup(f.read())
    except (FileNotFoundError, ProcessLookupError):
        return None


def thread_name(pid: int, tid: int) -> str:
    try:  # stdlib only (the guest has no psutil)
        with open(f"/proc/{pid}/task/{tid}/comm") as f:
            return f.read().rstrip("\n")
    except (FileNotFoundError, ProcessLookupError):
        return ""


def process_of(tid: int) -> int | None:
    """The thread group (process) a thread id belongs to; None when it has exited."""
    try:  # psutil has no thread group id (Tgid) of a thread
        with open(f"/proc/{tid}/status") as f:
            for line in f:
                if line.startswith("Tgid:"):
                    return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None
