"""The shim's fork servers (shim/contract/forkserver.py) that this checkout's code
started: on a node a fork server outlives its pods by design (it exits once no pod it
forked runs and it has been idle 10 minutes), but a test run or the demo leaves nothing
running, so each stops its own at its end. Another checkout's or an installed podvm's
servers have another code identity in their socket's name and are left alone."""
from __future__ import annotations

import os
import signal
import time

from podvm_core.treegc import FORK_SERVER, WORKER_PARENT, alive
from shim.contract import identity

from .shimproc import processes


def own() -> list[int]:
    """The pids of the running fork servers of this checkout's code."""
    mark = f"/{identity.own()}-".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if cmdline.startswith(FORK_SERVER) and mark in cmdline:
            found.append(int(entry))
    return found


def stop_own(wait: float = 10.0) -> list[int]:
    """SIGTERM to each (it removes its socket and exits); the pids still running after
    `wait` seconds."""
    pids = own()
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + wait
    while (left := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def wait_loaded(timeout: float = 60.0) -> bool:
    """Whether a fork server of this checkout's code runs with its worker parent (loaded
    as far as a process list tells) within `timeout` seconds: what a node where pods have
    been starting has, and a bench's first figures would otherwise measure its spawn."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        servers = set(own())
        if servers and any(parent in servers for _, parent in processes(*WORKER_PARENT)):
            return True
        time.sleep(0.1)
    return False
