"""The node-wide allocator of exclusive CPUs: several processes at once, crash safety."""
from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time

import pytest

from shim.cpus.allocator import STATE, Allocator, AllocatorError, NoFreeCPUs, choose


def sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_reserve_release_and_the_shared_pool(tmp_path) -> None:
    a = Allocator(str(tmp_path), pool="0-3", reserved="0")
    assert a.reserve("pod-a", 2) == {2, 3}  # from the top: CPU 0 stays shared longest
    assert a.reserve("pod-a", 2) == {2, 3}  # the same again: idempotent
    assert a.shared_pool() == {1}
    with pytest.raises(NoFreeCPUs, match=r"sandbox pod-b asks for 2 exclusive CPU\(s\) but only "
                                         r"1 of the node's 3 \(1-3\) are free; held by: pod-a "
                                         r"\(2-3\); 0 reserved for the system"):
        a.reserve("pod-b", 2)
    assert a.reserve("pod-b", 1) == {1} and a.shared_pool() == set()
    assert a.reservations() == {"pod-a": {2, 3}, "pod-b": {1}}
    assert a.release("pod-a") == {2, 3}
    assert a.release("pod-a") == set()  # idempotent
    assert a.shared_pool() == {2, 3}
    with pytest.raises(ValueError, match="at least 1 CPU, not 0"):
        a.reserve("pod-c", 0)


def test_two_pods_on_two_cpus_get_one_each_and_a_third_is_refused(tmp_path) -> None:
    a = Allocator(str(tmp_path), pool="0-1")
    assert a.reserve("pod-a", 1) == {1} and a.reserve("pod-b", 1) == {0}
    with pytest.raises(NoFreeCPUs, match=r"asks for 1 exclusive CPU\(s\) but only 0 of the "
                                         r"node's 2 \(0-1\) are free; held by: pod-a \(1\), "
                                         r"pod-b \(0\)$"):
        a.reserve("pod-c", 1)


def test_a_pod_asking_again_keeps_its_cpus(tmp_path) -> None:
    a = Allocator(str(tmp_path), pool="0-7")
    assert a.reserve("pod-b", 1) == {7}
    assert a.reserve("pod-a", 2) == {5, 6}
    assert a.reserve("pod-a", 4) == {3, 4, 5, 6}  # grown around the CPUs it has
    assert a.reserve("pod-a", 1) == {6}  # shrunk: the lowest go back
    assert a.shared_pool() == {0, 1, 2, 3, 4, 5}
    with pytest.raises(NoFreeCPUs, match="only 7 of the node's 8"):
        a.reserve("pod-a", 8)
    assert a.reservations()["pod-a"] == {6}  # a refused resize keeps what it had


def test_whole_cores_first_highest_first() -> None:
    smt = {0: {0, 4}, 4: {0, 4}, 1: {1, 5}, 5: {1, 5}, 2: {2, 6}, 6: {2, 6}, 3: {3, 7},
           7: {3, 7}}
    smt = {c: frozenset(s) for c, s in smt.items()}
    assert choose(range(8), 2, smt) == [7, 3]  # a whole core: no neighbour on the sibling
    assert choose(range(8), 3, smt) == [7, 3, 6]
    # A half-taken core is filled before a whole one is split.
    assert choose({0, 4, 1, 5, 2}, 1, smt) == [2]
    assert choose({0, 4, 1, 5, 2}, 3, smt) == [5, 1, 2]
    with pytest.raises(ValueError):
        choose({1}, 2, smt)


def test_cores_read_from_the_host_topology(tmp_path) -> None:
    sys_cpu = tmp_path / "sys"
    for cpu in range(4):
        (sys_cpu / f"cpu{cpu}" / "topology").mkdir(parents=True)
        (sys_cpu / f"cpu{cpu}" / "topology" / "thread_siblings_list").write_text(
            f"{cpu % 2},{cpu % 2 + 2}\n")
    (sys_cpu / "online").write_text("0-3\n")
    a = Allocator(str(tmp_path / "run"), sys_cpu=str(sys_cpu))
    assert a.pool == {0, 1, 2, 3}
    assert a.reserve("pod-a", 2) == {1, 3}
    assert a.reserve("pod-b", 1) == {2}


def test_cpus_of_a_killed_shim_are_reclaimed(tmp_path) -> None:
    a = Allocator(str(tmp_path), pool="0-1")
    shim = sleeper()
    try:
        assert a.reserve("pod-a", 2, owner_pid=shim.pid) == {0, 1}
        with pytest.raises(NoFreeCPUs):
            a.reserve("pod-b", 1)
        before = a.version()
    finally:
        shim.send_signal(signal.SIGKILL)
        shim.wait()
    assert a.reservations() == {} and a.shared_pool() == {0, 1}  # readers see it at once
    assert a.version() != before  # pods in the shared pool notice
    assert a.reserve("pod-b", 1) == {1}
    assert set(json.loads((tmp_path / STATE).read_text())) == {"pod-b"}  # and it is gone


def test_a_reused_pid_does_not_keep_the_cpus(tmp_path) -> None:
    (tmp_path / STATE).write_text(json.dumps(
        {"old-pod": {"cpus": [0, 1], "pid": os.getpid(), "start_time": 1}}))
    a = Allocator(str(tmp_path), pool="0-1")
    assert a.reservations() == {}  # our pid, but not the process that reserved
    assert a.reserve("pod-b", 2) == {0, 1}


def test_a_refusal_still_frees_the_dead(tmp_path) -> None:
    (tmp_path / STATE).write_text(json.dumps(
        {"dead": {"cpus": [0], "pid": 2 ** 22 + 1, "start_time": 5}}))
    a = Allocator(str(tmp_path), pool="0")
    with pytest.raises(NoFreeCPUs):
        a.reserve("pod-a", 2)
    assert json.loads((tmp_path / STATE).read_text()) == {}


def test_an_owner_that_is_not_running_is_refused(tmp_path) -> None:
    gone = sleeper()
    gone.kill()
    gone.wait()
    with pytest.raises(ValueError, match=f"owner process {gone.pid} is not running"):
        Allocator(str(tmp_path), pool="0-1").reserve("pod-a", 1, owner_pid=gone.pid)


def test_an_unreadable_state_refuses_rather_than_double_books(tmp_path) -> None:
    (tmp_path / STATE).write_text('{"pod-a": {"cpus": [0], "pid"')
    a = Allocator(str(tmp_path), pool="0-1")
    with pytest.raises(AllocatorError, match=f"{tmp_path / STATE}: unreadable"):
        a.reserve("pod-b", 1)
    (tmp_path / STATE).write_text('{"pod-a": {"cpus": "0"}}')
    with pytest.raises(AllocatorError, match="not podvm's reservations"):
        a.shared_pool()


def test_writes_are_atomic_and_leave_nothing_behind(tmp_path) -> None:
    (tmp_path / f"{STATE}.999999.tmp").write_text("{")  # a writer that died mid-write
    a = Allocator(str(tmp_path), pool="0-3")
    a.reserve("pod-a", 1)
    a.release("pod-a")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lock", STATE]


def test_a_pool_with_nothing_left_is_an_error(tmp_path) -> None:
    with pytest.raises(AllocatorError, match="no CPU is left for pods: the pool 0-1 less the "
                                             "reserved 0-1"):
        Allocator(str(tmp_path), pool="0-1", reserved="0-1")


def _reserve(directory: str, name: str, queue) -> None:
    try:
        cpus = Allocator(directory, pool="0-7").reserve(name, 2, owner_pid=os.getppid())
        queue.put((name, sorted(cpus)))
    except NoFreeCPUs:
        queue.put((name, None))


def test_concurrent_shims_never_share_a_cpu(tmp_path) -> None:
    ctx = multiprocessing.get_context("spawn")  # fork from a threaded pytest can deadlock
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
    assert Allocator(str(tmp_path), pool="0-7").shared_pool() == set()


def _shim(directory: str, name: str, queue) -> None:
    """A shim: holds one CPU for itself, churns another, lives until killed. The pool
    has room for every shim's two at once: the race tested is on the file, not for CPUs."""
    a = Allocator(directory, pool="0-11")
    cpus = a.reserve(name, 1)
    for i in range(20):
        try:
            a.reserve(f"{name}-churn", 1)
        except NoFreeCPUs:
            pass
        a.release(f"{name}-churn")
    queue.put((name, sorted(cpus)))
    time.sleep(60)


def test_shims_racing_and_dying(tmp_path) -> None:
    ctx = multiprocessing.get_context("spawn")  # fork from a threaded pytest can deadlock
    queue = ctx.Queue()
    procs = [ctx.Process(target=_shim, args=(str(tmp_path), f"pod-{i}", queue))
             for i in range(6)]
    for p in procs:
        p.start()
    try:
        held = dict(queue.get(timeout=60) for _ in procs)
        flat = [c for cpus in held.values() for c in cpus]
        assert len(flat) == len(set(flat)) == 6  # nobody shares
        a = Allocator(str(tmp_path), pool="0-11")
        assert {k: sorted(v) for k, v in a.reservations().items()} == held
        for p in procs[:3]:
            os.kill(p.pid, signal.SIGKILL)
            p.join()
        survivors = {f"pod-{i}" for i in range(3, 6)}
        assert set(a.reservations()) == survivors
        freed = a.reserve("new-pod", 5)  # the dead ones' CPUs among them
        assert not freed & {c for s in survivors for c in held[s]}
    finally:
        for p in procs:
            p.kill()
            p.join()
