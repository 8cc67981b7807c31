"""The node-wide allocator of exclusive CPUs: several processes at once, crash safety."""
from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys

import pytest

from shim.cpus.allocator import Allocator, NoFreeCPUs


def test_reserve_release_and_the_shared_pool(tmp_path) -> None:
    a = Allocator(str(tmp_path), pool="0-3", reserved="0")
    assert a.reserve("pod-a", 2) == {1, 2}
    assert a.reserve("pod-a", 2) == {1, 2}  # the same again: idempotent
    assert a.shared_pool() == {3}
    with pytest.raises(NoFreeCPUs, match=r"asks for 2 exclusive CPU\(s\) but only 1 of the "
                                         r"node's 3 \(1-3\) are free; held by: pod-a \(1-2\)"):
        a.reserve("pod-b", 2)
    assert a.reserve("pod-b", 1) == {3} and a.shared_pool() == set()
    a.release("pod-a")
    a.release("pod-a")  # idempotent
    assert a.shared_pool() == {1, 2}
    with pytest.raises(ValueError):
        a.reserve("pod-c", 0)


def test_cpus_of_a_dead_shim_are_reclaimed(tmp_path) -> None:
    a = Allocator(str(tmp_path), pool="0-1")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert a.reserve("pod-a", 2, pid=child.pid) == {0, 1}
        with pytest.raises(NoFreeCPUs):
            a.reserve("pod-b", 1)
    finally:
        child.kill()
        child.wait()
    assert a.reserve("pod-b", 1) == {0}  # the dead holder's CPUs are free again
    assert set(a.reservations()) == {"pod-b"}


def _reserve(directory: str, name: str, queue) -> None:
    try:
        queue.put((name, sorted(Allocator(directory, pool="0-7").reserve(name, 2,
                                                                          pid=os.getppid()))))
    except NoFreeCPUs:
        queue.put((name, None))


def test_concurrent_shims_never_share_a_cpu(tmp_path) -> None:
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_reserve, args=(str(tmp_path), f"pod-{i}", queue))
             for i in range(6)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=30) for _ in procs)
    for p in procs:
        p.join()
    granted = [cpus for cpus in results.values() if cpus]
    assert len(granted) == 4 and sum(r is None for r in results.values()) == 2
    flat = [c for cpus in granted for c in cpus]
    assert sorted(flat) == list(range(8))
