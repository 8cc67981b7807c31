"""How a VMM child ended, read before asyncio's child watcher has reaped it (on a busy
machine it may run late): the exit status or the signal, and the child left to reap."""
from __future__ import annotations

import os
import signal
import subprocess
import time

from shim.host.processes import peek_exit


def ended(proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 10
    while peek_exit(proc.pid) is None:
        assert time.monotonic() < deadline, "the child never ended"
        time.sleep(0.01)


def test_a_killed_child_reads_as_its_signal_and_stays_to_be_reaped() -> None:
    proc = subprocess.Popen(["sleep", "100"])
    assert peek_exit(proc.pid) is None  # running
    os.kill(proc.pid, signal.SIGKILL)
    ended(proc)
    assert peek_exit(proc.pid) == peek_exit(proc.pid) == -signal.SIGKILL  # not reaped
    assert proc.wait(5) == -signal.SIGKILL
    assert peek_exit(proc.pid) is None  # reaped: nothing left to read


def test_an_exit_status() -> None:
    proc = subprocess.Popen(["sh", "-c", "exit 3"])
    ended(proc)
    assert peek_exit(proc.pid) == 3
    proc.wait(5)
