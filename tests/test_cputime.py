"""testbed/cputime.py, the plugin that shows where the suite's time goes: each CPU's
busy and idle time, each test's time on each CPU, and each file's wall time beside the
CPU time left idle meanwhile."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from testbed import cputime
from testbed.vmconfig import ROOT


def test_each_cpu_s_busy_and_idle_time_only_grows() -> None:
    started, before = time.monotonic(), cputime.cpu_times()
    assert len(before) == os.cpu_count()
    time.sleep(0.2)
    after, wall = cputime.cpu_times(), time.monotonic() - started
    for (was_busy, was_idle), (busy, idle) in zip(before, after):
        assert busy >= was_busy and idle >= was_idle
        # each CPU accounted the time one way or the other (the kernel's ticks: a tick
        # or two either way)
        assert wall - 0.05 <= (busy + idle) - (was_busy + was_idle) <= wall + 0.05


def test_a_run_shows_each_test_s_cpu_time_and_each_file_s_idle_time(tmp_path) -> None:
    """Bounds that hold on a shared machine: a test that spins on one CPU keeps that
    CPU busy whatever else runs; what each CPU did adds up to the wall time; the table
    sums the idle time of each file's tests."""
    spin_cpu = max(os.sched_getaffinity(0))  # not make test-busy's loop's, the first
    (tmp_path / "test_waits.py").write_text(textwrap.dedent("""
        import time
        def test_waits():
            time.sleep(1)
    """))
    (tmp_path / "test_works.py").write_text(textwrap.dedent(f"""
        import os, time
        def test_works():
            os.sched_setaffinity(0, {{{spin_cpu}}})
            end = time.monotonic() + 1
            while time.monotonic() < end:
                pass
    """))
    tsv = tmp_path / "tests.tsv"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "testbed.cputime", "-q", "-p",
         "no:cacheprovider", str(tmp_path)], cwd=tmp_path, capture_output=True, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), "PODVM_CPUTIME_TSV": str(tsv)},
        timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "wall time and idle CPU time by file" in run.stdout
    tests = {}
    for line in tsv.read_text().splitlines():
        nodeid, wall, *times = line.split("\t")
        cpus = [(float(busy), float(idle)) for busy, idle in zip(times[::2], times[1::2])]
        tests[nodeid.split("::")[0]] = float(wall), cpus
    assert sorted(tests) == ["test_waits.py", "test_works.py"]
    for wall, cpus in tests.values():
        assert wall >= 1 and len(cpus) == os.cpu_count()
        for busy, idle in cpus:  # the kernel's ticks: a tick or two either way
            assert wall - 0.05 <= busy + idle <= wall + 0.05, (wall, cpus)
    wall, cpus = tests["test_works.py"]
    assert cpus[spin_cpu][0] >= 0.9 * wall, (spin_cpu, cpus)
    shown = {line.split()[-1]: (float(line.split()[0]), float(line.split()[1]))
             for line in run.stdout.splitlines() if line.rstrip().endswith(".py")}
    for name, (wall, cpus) in tests.items():
        assert shown[name] == pytest.approx((wall, sum(idle for _, idle in cpus)),
                                            abs=0.1), (name, shown)
