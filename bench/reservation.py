"""The "Mind the Gap" experiment (Liu et al., SoCC '21) on this machine: does a pod get the
CPU it requested when noisy neighbours share the node? CPU shares promise a proportion of
contended time, per runqueue; exclusive CPUs (podvm's cpu_reservation = "exclusive")
promise the CPUs themselves.

Pods are host cgroups made by the cgroups package podvm uses (v1 or v2, whatever this
host has), under a private parent, without VMs: the figures are about the scheduler.
- target pod: requests 1 CPU, limited to 1 CPU. Workloads, one after the other: a
  single-threaded batch loop (CPU received / CPU requested) and an interactive one that
  sleeps 1 ms in a loop and measures how late it wakes up (p50, p99).
- neighbour pods fill the rest of the machine without over-committing it: "burstable"
  requests half of the other CPUs and has no limit, "capped" requests the other half and
  is limited to it. Together they run --threads-per-cpu busy threads per CPU of the
  machine (x2 by default: the many-threaded neighbour the paper found most harmful).
- settings: "alone" (no neighbours), "shares" (cpu.shares / cpu.weight from the requests,
  as kubelet sets them) and "exclusive" (the target's CPU comes from podvm's allocator,
  the neighbours get the shared pool: on 2 CPUs the target has CPU 1, they have CPU 0).
It scales to the machine's CPUs; on a 2-CPU machine it only shows the method. Each setting
runs --repeat times, interleaved; the table (bench/reservation_table.py) gives medians and
ranges, --json writes every figure. Everything it creates is removed at the end, also on
Ctrl-C or SIGTERM; busy neighbours die with it even on SIGKILL, and cgroups left by a
killed run are removed by the next one. bench/reservation_vms.py runs the same experiment
with podvm pods.

usage: sudo python3 bench/reservation.py [--seconds S] [--threads-per-cpu N] [--repeat R]
                                         [--json FILE]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import benchcgroups  # noqa: E402
import cgroups  # noqa: E402
import reservation_table  # noqa: E402
from cgroups import CgroupLimits, SandboxCgroup, SandboxLayout  # noqa: E402
from reservation_table import Column  # noqa: E402
from shim.cpus.allocator import Allocator  # noqa: E402
from shim.cpus.cpuset import format_cpu_list  # noqa: E402

PARENT_PREFIX = "podvm-reservation-"
PERIOD_US = benchcgroups.PERIOD_US
SETTINGS = ("alone", "shares", "exclusive")
COLUMNS = (Column("cpu_ratio", "CPU recv/req", vs_alone=True),
           Column("p50_ms", "wake p50 ms", digits=3),
           Column("p99_ms", "wake p99 ms", digits=3, vs_alone=True))
TICKS = os.sysconf("SC_CLK_TCK")

# Every workload dies with the bench (PR_SET_PDEATHSIG) and stops by itself at a deadline.
PRELUDE = """import ctypes, json, os, sys, time
ctypes.CDLL(None).prctl(1, 9)
if os.getppid() != int(sys.argv[1]):
    sys.exit(1)
seconds = float(sys.argv[2])
"""
BUSY = PRELUDE + """end = time.monotonic() + seconds
while time.monotonic() < end:
    pass
"""
BATCH = PRELUDE + """start = time.monotonic()
end = start + seconds
while time.monotonic() < end:
    pass
print(json.dumps({"cpu": time.process_time(), "wall": time.monotonic() - start}))
"""
INTERACTIVE = PRELUDE + """end, late = time.monotonic() + seconds, []
while time.monotonic() < end:
    t = time.perf_counter()
    time.sleep(0.001)
    late.append(time.perf_counter() - t - 0.001)
late.sort()
print(json.dumps({"p50": late[len(late) // 2], "p99": late[int(len(late) * 0.99)]}))
"""


@dataclass(frozen=True)
class PodShape:
    name: str
    request: float
    """CPUs requested: cpu.shares = 1024 per CPU."""
    limit: float | None
    """CPUs allowed by the CFS quota; None: no limit."""
    threads: int

    @property
    def shares(self) -> int:
        return max(2, round(self.request * 1024))

    @property
    def quota_us(self) -> int | None:
        return None if self.limit is None else max(1000, round(self.limit * PERIOD_US))


def shapes(cpus: int, threads_per_cpu: int) -> tuple[PodShape, list[PodShape]]:
    """The target and its neighbours on a machine with `cpus` CPUs: the requests add up
    to the machine, no more; the neighbours' threads oversubscribe it."""
    rest = cpus - 1
    threads = max(2, threads_per_cpu * cpus)
    target = PodShape("target", 1.0, 1.0, 1)
    return target, [PodShape("burstable", rest / 2, None, threads - threads // 2),
                    PodShape("capped", rest / 2, rest / 2, threads // 2)]


class Node:
    """The pods of one setting, under a private parent cgroup named after this process."""

    def __init__(self, manager: cgroups.CgroupManager) -> None:
        self.manager = manager
        self.parent = f"/{PARENT_PREFIX}{os.getpid()}"
        self.pods: list[SandboxCgroup] = []
        self.procs: list[subprocess.Popen] = []

    def pod(self, shape: PodShape, cpuset: str | None) -> SandboxCgroup:
        limits = CgroupLimits(cpu_shares=shape.shares, cpu_quota_us=shape.quota_us,
                              cpu_period_us=PERIOD_US if shape.quota_us else None,
                              cpuset_cpus=cpuset).restricted_to(self.manager.controllers)
        pod = SandboxCgroup.create(SandboxLayout(self.parent, shape.name), limits,
                                   self.manager)
        self.pods.append(pod)
        if len(self.pods) == 1:
            benchcgroups.outweigh_the_rest(self.manager, self.parent)
        return pod

    def run(self, pod: SandboxCgroup, code: str, seconds: float, **kw) -> subprocess.Popen:
        proc = pod.spawn([sys.executable, "-c", code, str(os.getpid()), str(seconds)], **kw)
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        for pod in self.pods:
            pod.destroy()
        benchcgroups.remove_tree(self.manager, self.parent)


def sweep_stale(manager: cgroups.CgroupManager) -> None:
    """Parent cgroups and allocator directories of runs that were killed."""
    benchcgroups.sweep_stale(manager, PARENT_PREFIX)
    for name in benchcgroups.stale(tempfile.gettempdir(), PARENT_PREFIX):
        shutil.rmtree(os.path.join(tempfile.gettempdir(), name), ignore_errors=True)


def cpu_seconds(pids: list[int]) -> float:
    """utime + stime of live processes, from /proc/<pid>/stat."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError, IndexError):
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
    return total / TICKS


def affinity(pid: int) -> str:
    with contextlib.suppress(OSError):
        return format_cpu_list(os.sched_getaffinity(pid))
    return "?"


def setting(mode: str, seconds: float, cpus: int, threads_per_cpu: int,
            manager: cgroups.CgroupManager) -> dict:
    """One setting ("alone", "shares", "exclusive"): the target's figures, the
    neighbours' CPU received / requested, and where each ran."""
    node = Node(manager)
    allocator_dir = tempfile.mkdtemp(prefix=f"{PARENT_PREFIX}{os.getpid()}-")
    try:
        target_shape, neighbour_shapes = shapes(cpus, threads_per_cpu)
        mine = others = None
        if mode == "exclusive":
            allocator = Allocator(allocator_dir, pool=format_cpu_list(os.sched_getaffinity(0)))
            mine = format_cpu_list(allocator.reserve("target", 1))
            others = format_cpu_list(allocator.shared_pool())
        target = node.pod(target_shape, mine)
        neighbours: list[tuple[PodShape, list[int]]] = []
        if mode != "alone":
            for shape in neighbour_shapes:
                pod = node.pod(shape, others)
                neighbours.append((shape, [node.run(pod, BUSY, 2 * seconds + 60).pid
                                           for _ in range(shape.threads)]))
            time.sleep(0.5)  # the neighbours are running before the target starts
        before = [cpu_seconds(pids) for _, pids in neighbours]
        start = time.monotonic()
        batch = node.run(target, BATCH, seconds, stdout=subprocess.PIPE, text=True)
        where = {"target": affinity(batch.pid)}
        where.update({shape.name: affinity(pids[0]) for shape, pids in neighbours})
        ran = json.loads(batch.communicate()[0])
        inter = node.run(target, INTERACTIVE, seconds, stdout=subprocess.PIPE, text=True)
        latency = json.loads(inter.communicate()[0])
        wall = time.monotonic() - start
        received = {shape.name: (cpu_seconds(pids) - b) / wall / shape.request
                    for (shape, pids), b in zip(neighbours, before)}
        return {"setting": mode, "cpu_ratio": ran["cpu"] / ran["wall"] / target_shape.request,
                "p50_ms": latency["p50"] * 1000, "p99_ms": latency["p99"] * 1000,
                "neighbours": received, "where": where}
    finally:
        node.close()
        shutil.rmtree(allocator_dir, ignore_errors=True)


def cpu_model() -> str:
    for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def progress(r: dict, rep: int) -> str:
    """One line per measured setting, as it ends: its figures, the neighbours' CPU
    received / requested, and where each pod ran."""
    neighbours = ", ".join(f"{n} {v:.2f}" for n, v in r["neighbours"].items()) or "-"
    where = ", ".join(f"{n} {c}" for n, c in r["where"].items())
    return (f"{r['setting']} #{rep + 1}: CPU recv/req {r['cpu_ratio']:.2f}, wake p50 "
            f"{r['p50_ms']:.3f} ms p99 {r['p99_ms']:.3f} ms; neighbours recv/req "
            f"{neighbours}; where (CPUs): {where}")


def main(argv: list[str] | None = None) -> int:
    intro, _, details = (__doc__ or "").partition("\n\n")
    p = argparse.ArgumentParser(description=intro, epilog=details,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=8,
                   help="seconds each workload runs in each setting; a run takes about 6x "
                        "this plus a few seconds (default 8)")
    p.add_argument("--threads-per-cpu", type=int, default=2,
                   help="neighbours' busy threads per CPU of the machine (default 2)")
    p.add_argument("--repeat", type=int, default=1,
                   help="runs of each setting, interleaved (default 1)")
    p.add_argument("--json", metavar="FILE", help="also write every figure to FILE")
    args = p.parse_args(argv)
    if args.seconds <= 0 or args.threads_per_cpu < 1 or args.repeat < 1:
        p.error("--seconds must be > 0, --threads-per-cpu and --repeat at least 1")
    if os.geteuid() != 0:
        print("reservation.py: needs root (it makes cgroups)", file=sys.stderr)
        return 1
    cpus = len(os.sched_getaffinity(0))
    if cpus < 2:
        print(f"reservation.py: needs at least 2 CPUs, this process may use {cpus}",
              file=sys.stderr)
        return 1
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    manager = cgroups.detect()
    sweep_stale(manager)
    target, neighbours = shapes(cpus, args.threads_per_cpu)
    machine = {"cpus": cpus, "online": os.cpu_count(), "model": cpu_model(),
               "kernel": platform.release(), "cgroup": manager.version}
    print(f"machine: {cpus} CPUs of {os.cpu_count()} ({cpu_model()}), kernel "
          f"{platform.release()}, cgroup v{manager.version}")
    print(f"target requests {target.request:g} CPU (limit {target.limit:g}); neighbours: " +
          ", ".join(f"{n.name} requests {n.request:g} CPU "
                    f"({'no limit' if n.limit is None else f'limit {n.limit:g}'}), "
                    f"{n.threads} busy threads" for n in neighbours) +
          f"; {args.seconds:g} s per workload", flush=True)
    results = []
    try:
        for rep, mode in reservation_table.interleaved(SETTINGS, args.repeat):
            r = setting(mode, args.seconds, cpus, args.threads_per_cpu, manager)
            results.append(dict(r, rep=rep))
            print(progress(r, rep), flush=True)
    except KeyboardInterrupt:
        print("reservation.py: interrupted; what it made is removed", file=sys.stderr)
        return 130
    print(reservation_table.table(results, COLUMNS), flush=True)
    if args.json:
        reservation_table.write_json(args.json, reservation_table.document(
            machine, {"seconds": args.seconds, "threads_per_cpu": args.threads_per_cpu,
                      "repeat": args.repeat}, COLUMNS, results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
