"""Where the suite's time goes: a pytest plugin, loaded on demand
(`make test-busy PYTEST_ARGS="-p testbed.cputime"`), that reads each CPU's busy and idle
time from /proc/stat around every test (its setup, call and teardown) and prints, at the
end, each file's wall time beside the CPU time the machine left idle while it ran: a file
whose idle time is near its wall time waits (on a deadline, a timeout, a guest), one
whose idle time is near zero works. With `make test-busy`'s loop holding one CPU, the
idle time is the other CPUs' alone: the room the suite left unused. PODVM_CPUTIME_TSV
names a file that gets one line a test: its id, wall seconds, then each CPU's busy and
idle seconds (cpu0 first)."""
from __future__ import annotations

import collections
import os
import time

import psutil
import pytest

SHOWN = 40
"""Files listed, the longest first."""


def cpu_times() -> list[tuple[float, float]]:
    """Each CPU's (busy, idle) seconds since boot, by CPU number, as psutil reads them
    from /proc/stat: idle is idle and iowait, busy the rest (guest time is within user
    time there, so it is not counted again)."""
    times = []
    for cpu in psutil.cpu_times(percpu=True):
        idle = cpu.idle + cpu.iowait
        busy = cpu.user + cpu.nice + cpu.system + cpu.irq + cpu.softirq + cpu.steal
        times.append((busy, idle))
    return times


_tests: list[tuple[str, float, list[tuple[float, float]]]] = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    started, before = time.monotonic(), cpu_times()
    yield
    ended, after = time.monotonic(), cpu_times()
    spent = [(busy - was_busy, idle - was_idle)
             for (was_busy, was_idle), (busy, idle) in zip(before, after)]
    _tests.append((item.nodeid, ended - started, spent))


def pytest_terminal_summary(terminalreporter) -> None:
    if not _tests:
        return
    out = os.environ.get("PODVM_CPUTIME_TSV")
    if out:
        with open(out, "w") as f:
            for nodeid, wall, spent in _tests:
                f.write("\t".join([nodeid, f"{wall:.2f}"] + [
                    f"{busy:.2f}\t{idle:.2f}" for busy, idle in spent]) + "\n")
    files: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for nodeid, wall, spent in _tests:
        row = files[nodeid.split("::")[0]]
        row[0] += wall
        row[1] += sum(idle for _, idle in spent)
        row[2] += 1
    wall = sum(row[0] for row in files.values())
    idle = sum(row[1] for row in files.values())
    write = terminalreporter.write_line
    terminalreporter.section("wall time and idle CPU time by file (testbed/cputime.py)")
    write(f"{'wall s':>8} {'idle CPU s':>10} {'tests':>5}  file")
    for name, row in sorted(files.items(), key=lambda kv: -kv[1][0])[:SHOWN]:
        write(f"{row[0]:8.1f} {row[1]:10.1f} {row[2]:5d}  {name}")
    write(f"{wall:8.1f} {idle:10.1f} {len(_tests):5d}  all {len(files)} files, "
          f"{len(next(iter(_tests))[2])} CPUs")
