"""Processes seen from outside: killed until no thread is left, told apart by start time."""
from __future__ import annotations

import os
import subprocess
import sys
import time

from shim.host.processes import is_our_shim, kill_and_wait, start_time

THREADED = ("import threading, time\n"
            "for _ in range(8): threading.Thread(target=time.sleep, args=(60,)).start()\n"
            "print('ready', flush=True); time.sleep(60)\n")


def test_a_killed_process_leaves_no_thread_behind() -> None:
    proc = subprocess.Popen([sys.executable, "-c", THREADED], stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
    assert len(os.listdir(f"/proc/{proc.pid}/task")) == 9
    kill_and_wait(proc.pid)
    # Not reaped yet (we are its parent): a zombie leader alone, nothing else of it.
    assert os.listdir(f"/proc/{proc.pid}/task") == [str(proc.pid)]
    assert start_time(proc.pid) is None
    assert proc.wait() == -9
    kill_and_wait(proc.pid)  # gone: nothing to do


def test_start_time_tells_a_process_from_its_successor() -> None:
    mine = start_time(os.getpid())
    assert isinstance(mine, int) and mine == start_time(os.getpid())
    time.sleep(0.05)
    later = subprocess.Popen(["sleep", "5"])
    try:
        assert start_time(later.pid) > mine  # type: ignore[operator]
    finally:
        later.kill()
        later.wait()
    assert start_time(0) is None and start_time(later.pid) is None


def test_only_our_shim_is_ours() -> None:
    assert not is_our_shim(os.getpid())
    proc = subprocess.Popen(["containerd-shim-podvm-v2", "-c", "import time; time.sleep(5)"],
                            executable=sys.executable)
    try:
        deadline = time.monotonic() + 5
        while not is_our_shim(proc.pid):
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        proc.kill()
        proc.wait()
    assert not is_our_shim(proc.pid)
