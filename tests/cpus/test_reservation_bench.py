"""bench/reservation.py: its scale follows the machine; a short run prints its figures and
leaves no cgroup, process or file behind."""
from __future__ import annotations

import contextlib
import glob
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

import pytest

from shim.cpus.allocator import choose
from shim.cpus.cpuset import core_siblings, format_cpu_list
from testbed.prereqs import require, require_root

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import reservation  # noqa: E402


def ours() -> set[str]:
    """Cgroups of the bench in every hierarchy, and its allocator directories."""
    found = set(glob.glob(f"/sys/fs/cgroup/**/{reservation.PARENT_PREFIX}*", recursive=True))
    return found | set(glob.glob(os.path.join(tempfile.gettempdir(),
                                              f"{reservation.PARENT_PREFIX}*")))


@pytest.mark.parametrize("cpus", [2, 3, 24])
def test_neighbours_fill_the_rest_of_the_machine_without_overcommitting(cpus) -> None:
    target, neighbours = reservation.shapes(cpus, threads_per_cpu=2)
    assert target.request == target.limit == 1 and target.threads == 1
    assert target.request + sum(n.request for n in neighbours) == cpus
    assert sum(n.threads for n in neighbours) == 2 * cpus  # 2x oversubscribed
    burstable, capped = neighbours
    assert burstable.limit is None and capped.limit == capped.request
    assert capped.quota_us == round(capped.request * 100_000) and target.shares == 1024


def require_two_cpus() -> list[int]:
    """The CPUs this process may use (the bench's pool), at least 2: one for the target,
    the rest for its neighbours."""
    cpus = sorted(os.sched_getaffinity(0))
    require(len(cpus) >= 2, f"2 CPUs for the bench's target and its neighbours (this "
                            f"process may use {format_cpu_list(cpus)})")
    return cpus


def test_help_says_what_it_measures() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "bench/reservation.py"), "--help"],
                         capture_output=True, text=True, check=True).stdout
    assert "--seconds" in out and "exclusive" in out and "p99" in out


def test_on_one_cpu_the_bench_refuses_and_leaves_nothing() -> None:
    """Any machine: the bench confined to one CPU says it needs 2 and makes nothing."""
    require_root()
    before = ours()
    one = max(os.sched_getaffinity(0))
    run = subprocess.run([sys.executable, str(ROOT / "bench/reservation.py"), "--seconds",
                          "1"], capture_output=True, text=True, timeout=120,
                         preexec_fn=lambda: os.sched_setaffinity(0, {one}))
    assert run.returncode == 1 and run.stdout == ""
    assert "needs at least 2 CPUs, this process may use 1" in run.stderr, run.stderr
    assert ours() == before


def test_reservation_bench_smoke() -> None:
    require_root()
    cpus = require_two_cpus()
    before = ours()
    run = subprocess.run([sys.executable, str(ROOT / "bench/reservation.py"), "--seconds",
                          "1"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert out.startswith("machine: ") and "| setting | CPU recv/req |" in out
    rows = {cells[0]: cells for cells in (
        [c.strip() for c in line.strip("|").split("|")] for line in out.splitlines()
        if re.match(r"\| (alone|shares|exclusive) \|", line))}
    assert set(rows) == {"alone", "shares", "exclusive"}
    for cells in rows.values():
        assert float(cells[1]) > 0 and float(cells[4]) > 0  # CPU ratio, p99 ms
    # The target holds the CPU podvm's allocator picks from this pool (the highest, or the
    # highest core without an SMT sibling); the neighbours have all the others.
    target = choose(cpus, 1, core_siblings(cpus))
    rest = format_cpu_list(set(cpus) - set(target))
    exclusive = next(line for line in out.splitlines() if line.startswith("exclusive #1:"))
    assert exclusive.endswith(f"target {target[0]}, burstable {rest}, capped {rest}"), out
    assert ours() == before


def test_a_killed_run_leaves_nothing_running_and_the_next_sweeps_its_cgroups() -> None:
    require_root()
    require_two_cpus()
    import cgroups

    before = ours()
    bench = subprocess.Popen([sys.executable, str(ROOT / "bench/reservation.py"),
                              "--seconds", "5"], stdout=subprocess.DEVNULL)
    parent = f"{reservation.PARENT_PREFIX}{bench.pid}"

    def workloads() -> set[int]:
        found = set()
        for pattern in (f"/sys/fs/cgroup/{parent}/**/cgroup.procs",
                        f"/sys/fs/cgroup/*/{parent}/**/cgroup.procs"):
            for procs in glob.glob(pattern, recursive=True):
                with contextlib.suppress(FileNotFoundError):  # a setting's pods removed
                    found |= {int(pid) for pid in pathlib.Path(procs).read_text().split()}
        return found
    try:
        deadline = time.monotonic() + 60
        while not (started := workloads()):
            assert time.monotonic() < deadline, "the bench never started a workload"
            assert bench.poll() is None, f"the bench exited {bench.returncode}"
            time.sleep(0.1)
    finally:
        bench.kill()
        bench.wait()
    # Its workloads die with it (PR_SET_PDEATHSIG, or their parent check when they were
    # still starting): none left, in its cgroups or out of them.
    deadline = time.monotonic() + 60
    while any(os.path.exists(f"/proc/{pid}") for pid in started) or workloads():
        assert time.monotonic() < deadline, \
            f"workloads outlived the bench: {sorted(started | workloads())}"
        time.sleep(0.1)
    reservation.sweep_stale(cgroups.detect())
    assert ours() == before
