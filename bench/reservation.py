"""The "Mind the Gap" experiment (SoCC '21) on this machine: does a pod get the CPU it
requested when noisy neighbours share the node? CPU shares promise a proportion of
contended time; exclusive CPUs (podvm's cpu_reservation = "exclusive") promise the CPUs.

Pods are host cgroups made the way podvm makes a sandbox cgroup (the `cgroups` package,
v1 or v2, whatever this host has), without VMs so the figures are about scheduling:
- target pod: requests 1 CPU. Workloads, one at a time: a single-threaded batch loop
  (CPU received / CPU requested) and an interactive one (sleeps 1 ms, measures how late
  it wakes: p50/p99).
- neighbour pods: "burstable" (request 0.5 CPU, no limit) and "capped" (request 0.5 CPU,
  limited to all CPUs but one), each with 2 busy processes per CPU of the machine.
- modes: "shares" (cpu.shares / cpu.weight from the requests, as kubelet sets them) and
  "exclusive" (the target holds one CPU from podvm's allocator, neighbours get the rest).
Everything it creates is removed at the end, also on Ctrl-C.

usage: python bench/reservation.py [--seconds S]
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import subprocess
import sys
import tempfile
import time
import uuid

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import cgroups  # noqa: E402
from cgroups import CgroupLimits, SandboxCgroup, SandboxLayout  # noqa: E402
from cgroups.limits import format_cpu_list  # noqa: E402
from shim.cpus.allocator import Allocator  # noqa: E402

BUSY = "while True: pass"
BATCH = """import json, sys, time
start = time.monotonic()
end = start + float(sys.argv[1])
while time.monotonic() < end:
    pass
print(json.dumps({"cpu": time.process_time(), "wall": time.monotonic() - start}))
"""
INTERACTIVE = """import json, sys, time
end, late = time.monotonic() + float(sys.argv[1]), []
while time.monotonic() < end:
    t = time.perf_counter()
    time.sleep(0.001)
    late.append(time.perf_counter() - t - 0.001)
late.sort()
print(json.dumps({"p50": late[len(late) // 2], "p99": late[int(len(late) * 0.99)],
                  "n": len(late)}))
"""


def cpu_model() -> str:
    for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


class Node:
    """The pods of one experiment, under a private parent cgroup."""

    def __init__(self) -> None:
        self.parent = f"/podvm-reservation-{uuid.uuid4().hex[:8]}"
        self.manager = cgroups.detect()
        self.pods: list[SandboxCgroup] = []
        self.procs: list[subprocess.Popen] = []

    def pod(self, name: str, limits: CgroupLimits) -> SandboxCgroup:
        limits = limits.restricted_to(self.manager.controllers)
        pod = SandboxCgroup.create(SandboxLayout(self.parent, name), limits, self.manager)
        self.pods.append(pod)
        return pod

    def run(self, pod: SandboxCgroup, code: str, *args: str, **kw) -> subprocess.Popen:
        proc = pod.spawn([sys.executable, "-c", code, *args], **kw)
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        for pod in self.pods:
            pod.destroy()
        if isinstance(self.manager, cgroups.CgroupV2Manager):
            directories = [self.manager.hierarchy.directory(self.parent)]
        else:
            directories = [h.directory(self.parent) for h in self.manager.hierarchies]
        for directory in directories:  # the parent the pods were made under
            try:
                os.rmdir(directory)
            except FileNotFoundError:
                pass


def experiment(mode: str | None, seconds: float, cpus: list[int]) -> dict:
    """mode None: the target alone. Returns the target's figures."""
    node = Node()
    try:
        target_limits = CgroupLimits(cpu_shares=1024)
        others: str | None = None
        if mode == "exclusive":
            allocator = Allocator(tempfile.mkdtemp(prefix="podvm-bench-cpus-"))
            mine = allocator.reserve("target", 1)
            target_limits = CgroupLimits(cpu_shares=1024, cpuset_cpus=format_cpu_list(mine))
            others = format_cpu_list(allocator.shared_pool())
        target = node.pod("target", target_limits)
        if mode is not None:
            threads = 2 * len(cpus)
            burstable = node.pod("burstable", CgroupLimits(cpu_shares=512, cpuset_cpus=others))
            capped = node.pod("capped", CgroupLimits(
                cpu_shares=512, cpuset_cpus=others,
                cpu_quota_us=max(1, len(cpus) - 1) * 100_000, cpu_period_us=100_000))
            for pod in (burstable, capped):
                for _ in range(threads):
                    node.run(pod, BUSY)
            time.sleep(0.5)  # the neighbours are running before the target starts
        batch = node.run(target, BATCH, str(seconds), stdout=subprocess.PIPE, text=True)
        ran = json.loads(batch.communicate()[0])
        inter = node.run(target, INTERACTIVE, str(seconds), stdout=subprocess.PIPE, text=True)
        out, _ = inter.communicate()
        latency = json.loads(out)
        return {"cpu_ratio": ran["cpu"] / ran["wall"], "p50_ms": latency["p50"] * 1000,
                "p99_ms": latency["p99"] * 1000}
    finally:
        node.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--seconds", type=float, default=8,
                   help="seconds each workload runs in each setting (default 8)")
    args = p.parse_args()
    if os.geteuid() != 0:
        print("reservation.py: needs root (it makes cgroups)", file=sys.stderr)
        return 1
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        print("reservation.py: needs at least 2 CPUs", file=sys.stderr)
        return 1
    print(f"machine: {len(cpus)} CPUs ({cpu_model()}), kernel {platform.release()}, "
          f"cgroup v{cgroups.detect().version}; "
          f"neighbours: 2 pods x {2 * len(cpus)} busy processes")
    rows = []
    for label, mode in (("alone", None), ("shares, co-located", "shares"),
                        ("exclusive, co-located", "exclusive")):
        r = experiment(mode, args.seconds, cpus)
        rows.append((label, r))
        print(f"  {label:<24} CPU received / requested {r['cpu_ratio']:5.2f}   wake-up "
              f"latency p50 {r['p50_ms']:7.3f} ms  p99 {r['p99_ms']:8.3f} ms", flush=True)
    alone = rows[0][1]
    for label, r in rows[1:]:
        print(f"  {label}: p99 wake-up {r['p99_ms'] / max(alone['p99_ms'], 1e-6):.1f}x alone, "
              f"CPU {r['cpu_ratio'] / alone['cpu_ratio'] * 100:.0f}% of alone")
    return 0


if __name__ == "__main__":
    sys.exit(main())
