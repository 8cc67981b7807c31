"""Processes podvm started, seen from outside: their command line, whether one is ours,
and killing one until nothing of it is left."""
from __future__ import annotations

import logging
import os
import signal
import time

log = logging.getLogger("podvm.processes")


def cmdline(pid: int) -> bytes:
    """The process's command line; empty when it is gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def is_our_shim(pid: int) -> bool:
    return b"containerd-shim-podvm-v2" in cmdline(pid)


def kill_and_wait(pid: int, timeout: float = 30.0) -> None:
    """SIGKILL `pid` and return once every thread of it has finished exiting, so that
    nothing of it is left in a cgroup (an exiting thread cannot be moved out, and a
    dying leader shows as a zombie while its other threads are still exiting). A VMM
    with a large address space can take seconds to exit on a busy machine."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    delay = 0.001
    while _alive(pid):
        if time.monotonic() >= deadline:
            log.warning("process %d still exiting %.0fs after SIGKILL", pid, timeout)
            return
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


def _alive(pid: int) -> bool:
    """Some thread of it has not finished exiting (a zombie leader alone is done: its
    parent may never reap it)."""
    try:
        threads = os.listdir(f"/proc/{pid}/task")
        if threads != [str(pid)]:
            return bool(threads)
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return False
