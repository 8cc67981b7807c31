"""Processes podvm started, seen from outside: killing one until nothing of it is left,
ending and reaping children (whether one is ours and when it started: pids.py). psutil:
only `delete` with something to remove, the daemon's exit and the VM machinery load
this module, never `start` or an idle daemon."""
from __future__ import annotations

import logging
import os
import signal
import time
from typing import TYPE_CHECKING

import psutil

if TYPE_CHECKING:
    import asyncio

from .pids import is_our_shim, start_time  # noqa: F401 (their home: light, for `delete`)

log = logging.getLogger("podvm.processes")


def kill_and_wait(pid: int, timeout: float = 30.0) -> None:
    """SIGKILL `pid` and return once every thread of it has finished exiting, so that
    nothing of it is left in a cgroup (an exiting thread cannot be moved out, and a
    dying leader shows as a zombie while its other threads are still exiting). A VMM
    with a large address space can take seconds to exit on a busy machine."""
    try:
        proc = psutil.Process(pid)
        proc.kill()
    except psutil.NoSuchProcess:
        return
    deadline = time.monotonic() + timeout
    delay = 0.001
    while _alive(proc):
        if time.monotonic() >= deadline:
            log.warning("process %d still exiting %.0fs after SIGKILL", pid, timeout)
            return
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


async def end_child(proc: asyncio.subprocess.Process, timeout: float, what: str) -> None:
    """Wait up to `timeout` seconds for a child asked to end, then SIGKILL it; returns
    once it is reaped."""
    if proc.returncode is not None:
        return
    try:
        # Here, not at the top: `delete` kills with this module and has no loop
        import asyncio

        await asyncio.wait_for(proc.wait(), timeout)
    except TimeoutError:
        pass
    if proc.returncode is None:
        log.warning("killing %s %d", what, proc.pid)
        try:
            os.kill(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        await proc.wait()


def ended(proc: asyncio.subprocess.Process) -> bool:
    """The child has exited, reaped or not (a zombie)."""
    if proc.returncode is not None:
        return True
    try:
        return psutil.Process(proc.pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _alive(proc: psutil.Process) -> bool:
    """Some thread of it has not finished exiting (a zombie leader alone is done: its
    parent may never reap it)."""
    try:
        threads = [t.id for t in proc.threads()]
        if threads != [proc.pid]:
            return bool(threads)
        return proc.status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.NoSuchProcess:
        return False


def peek_exit(pid: int) -> int | None:
    """How a child that has ended did (as Popen.returncode: -N for signal N), read
    without reaping it: asyncio's child watcher, which reaps it, may not have run yet
    on a busy machine. None while it runs or once it is reaped."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return None
    if info is None:
        return None
    if info.si_code == os.CLD_EXITED:
        return info.si_status
    return -info.si_status  # CLD_KILLED, CLD_DUMPED
