"""bench/reservation.py: its scale follows the machine; a short run prints its figures and
leaves no cgroup, process or file behind."""
from __future__ import annotations

import glob
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

import pytest

from tests.conftest import require_root

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


def test_help_says_what_it_measures() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "bench/reservation.py"), "--help"],
                         capture_output=True, text=True, check=True).stdout
    assert "--seconds" in out and "exclusive" in out and "p99" in out


def test_reservation_bench_smoke() -> None:
    require_root()
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("the bench needs 2 CPUs")
    before = ours()
    run = subprocess.run([sys.executable, str(ROOT / "bench/reservation.py"), "--seconds",
                          "1"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert out.startswith("machine: ") and "CPU recv/req" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines()
            if re.match(r"(alone|shares|exclusive) ", line)}
    assert set(rows) == {"alone", "shares", "exclusive"}
    for fields in rows.values():
        assert float(fields[1]) > 0 and float(fields[4]) > 0  # CPU ratio, p99 ms
    cpus = sorted(os.sched_getaffinity(0))
    # The target holds the highest CPU, the neighbours have the others.
    assert f"target {cpus[-1]}, burstable {cpus[0]}" in " ".join(rows["exclusive"])
    assert ours() == before


def test_a_killed_run_leaves_nothing_running_and_the_next_sweeps_its_cgroups() -> None:
    require_root()
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("the bench needs 2 CPUs")
    import cgroups

    before = ours()
    bench = subprocess.Popen([sys.executable, str(ROOT / "bench/reservation.py"),
                              "--seconds", "5"], stdout=subprocess.DEVNULL)
    parent = f"{reservation.PARENT_PREFIX}{bench.pid}"

    def workloads() -> set[int]:
        return {int(pid) for pattern in (f"/sys/fs/cgroup/{parent}/**/cgroup.procs",
                                         f"/sys/fs/cgroup/*/{parent}/**/cgroup.procs")
                for procs in glob.glob(pattern, recursive=True)
                for pid in pathlib.Path(procs).read_text().split()}
    try:
        deadline = time.monotonic() + 30
        while not (started := workloads()):
            assert time.monotonic() < deadline, "the bench never started a workload"
            time.sleep(0.1)
    finally:
        bench.kill()
        bench.wait()
    deadline = time.monotonic() + 5
    while any(os.path.exists(f"/proc/{pid}") for pid in started):
        assert time.monotonic() < deadline, "workloads outlived the bench"
        time.sleep(0.1)
    reservation.sweep_stale(cgroups.detect())
    assert ours() == before
