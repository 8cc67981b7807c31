"""How long `podvm-node monitor` takes to scrape a node of N sandboxes (issue 27: 100
sandboxes under 50 ms). The node is made up but read the real way: each sandbox's
sandbox.json written by the real PodState code, its shim.json, a cgroup v2 tree of its
own (memory.current, memory.events, cgroup.threads) under a scratch mount point, all in a
scratch host root laid out as a node's (/run/podvm, /sys/fs/cgroup, /proc: the real one,
linked), and threads that exist: one process named and threaded like a QEMU (main, two vCPUs, an
iothread, vhost, call_rcu) and one like a virtiofsd, whose threads' schedstat every
sandbox's scrape reads, as it would its own (the vCPUs' time is read from their
cgroup's counter). Before each timed scrape the cgroups' memory charge and vCPU time move
(advance), as a live node's do, so those families are written anew; with --changing
every sandbox.json is saved anew too.

    .venv/bin/python bench/monitor_bench.py [--sandboxes 100] [--scrapes 30] [--changing]
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Iterator

from cgroups import SandboxLayout
from podvm_core.atomic import write_json
from shim import config
from shim.cpus.allocator import DEFAULT_DIR as CPUS_DIR
from shim.host import paths
from shim.host.podstate import CgroupState, PodState, VMReport, state_path
from shim.host.processes import start_time
from shim.resources import ContainerResources, Host, plan_sandbox
from shim.resources.model import request_from_config

from podvm_node.collect import Reader
from podvm_node.monitor import Exposition, NodeCollector

STATE, CGROUP = paths.STATE_ROOT.lstrip("/"), "sys/fs/cgroup"
TEMPLATES = config.HypervisorConfig.template_path.lstrip("/")
CPUS = CPUS_DIR.lstrip("/")
QEMU_THREADS = ("CPU 0/KVM", "CPU 1/KVM", "IO iothread0", "vhost-4242", "call_rcu")
FILES_THREADS = ("virtiofsd", "virtiofsd")
THREADS = """
import os, sys, threading, time
names = sys.argv[1:]
main_name, names = names[0], names[1:]
busy = float(os.environ.get("BUSY", "0"))
def name(n):
    with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as f:
        f.write(n[:15])
def run(n, ready):
    name(n)
    while n.startswith("IO ") and time.thread_time() < busy:  # CPU time, not the clock's
        pass
    ready.release()
    threading.Event().wait()
name(main_name)
ready = threading.Semaphore(0)
tids = []
for n in names:
    t = threading.Thread(target=run, args=(n, ready), daemon=True)
    t.start()
    tids.append(t.native_id)
for _ in names:
    ready.acquire()
print(" ".join(map(str, [threading.get_native_id()] + tids)), flush=True)
sys.stdin.read()
"""


class Threads:
    """A process whose threads have the given names; ended by close()."""

    def __init__(self, main_name: str, names: tuple[str, ...], busy: float = 0.0) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", THREADS, main_name, *names],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env={**os.environ, "BUSY": str(busy)})
        assert self.proc.stdout is not None
        ids = [int(t) for t in self.proc.stdout.readline().split()]
        self.pid, self.tids = ids[0], ids[1:]
        self.start_time = start_time(self.pid)

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=10)


def plan(cpus: float = 1.5, memory_mib: int = 256):
    return plan_sandbox(request_from_config(config.Config(), ContainerResources(
        cpu_quota=int(cpus * 100_000), cpu_period=100_000, memory_limit=memory_mib << 20)),
        Host(cpus=8, memory_mib=16384))


def make_sandbox(host: pathlib.Path, index: int, qemu: Threads, files: Threads,
                 namespace: str = "k8s.io") -> PodState:
    """One sandbox as a shim would have left it, its cgroup files as the kernel would."""
    sandbox_id = f"{index:04d}" + "ab" * 30
    layout = SandboxLayout(f"/kubepods/burstable/pod{index:04d}", sandbox_id)
    state = PodState(
        sandbox_id=sandbox_id,
        cgroup=CgroupState(manager={"version": 2, "mountpoint": "/" + CGROUP,
                                            "root": "/"},
                           layout=layout),
        plan=plan(), qmp_socket=f"/run/podvm/{namespace}/{sandbox_id}/vm/qmp.sock",
        qemu_pid=qemu.pid, qemu_start_time=qemu.start_time,
        vm=VMReport(online_cpus=2, memory_total_mib=1800, at=time.time(), qemu_vcpus=2,
                    qemu_memory_mib=2304),
        restored_from="a1b2c3" if index % 2 else "", pod_name=f"web-{index}",
        pod_namespace="team-a", boot_seconds=0.25 + index / 1000,
        agent_rtt_seconds=0.0004, guest_oom_kills=index % 3)
    directory = host / STATE / namespace / sandbox_id
    directory.mkdir(parents=True, mode=0o700)
    state.save(state_path(str(directory)))
    write_json(str(directory / "shim.json"), {"pid": os.getpid(), "address": "unix:///x"})
    sandbox = host / CGROUP / layout.sandbox.lstrip("/")
    vcpus = [t for t, n in zip(qemu.tids, QEMU_THREADS) if n.startswith("CPU ")]
    others = [qemu.pid] + [t for t in qemu.tids if t not in vcpus] + [files.pid] + files.tids
    for path, tids in ((sandbox, []), (sandbox / "vcpus", vcpus), (sandbox / "vmm", others)):
        path.mkdir(parents=True)
        (path / "cgroup.threads").write_text("".join(f"{t}\n" for t in tids))
    (sandbox / "memory.current").write_text(f"{(300 + index) << 20}\n")
    (sandbox / "vcpus" / "cpu.stat").write_text(f"usage_usec {vcpu_usec(index)}\n"
                                                 "user_usec 0\nsystem_usec 0\n")
    (sandbox / "memory.events").write_text(f"low 0\nhigh 0\nmax 2\noom {index % 2}\n"
                                           f"oom_kill {index % 2}\n")
    return state


def vcpu_usec(index: int) -> int:
    """What the `index`th sandbox's vcpus/ cgroup says its vCPUs used."""
    return 1_500_000 + index


@contextlib.contextmanager
def fake_node(count: int, busy: float = 0.0) -> Iterator[tuple[pathlib.Path, list[PodState]]]:
    """A scratch host root with `count` sandboxes: (its directory, the states written)."""
    with tempfile.TemporaryDirectory(prefix="podvm-monitor-") as tmp:
        root = pathlib.Path(tmp)
        (root / CGROUP).mkdir(parents=True)
        (root / CGROUP / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
        (root / "proc").symlink_to("/proc")
        qemu = Threads("qemu-system-x86", QEMU_THREADS, busy)
        files = Threads("virtiofsd", FILES_THREADS)
        try:
            states = [make_sandbox(root, i, qemu, files) for i in range(count)]
            yield root, states
        finally:
            qemu.close()
            files.close()


def exposition(root: pathlib.Path) -> Exposition:
    """The monitor's, for the host under `root`."""
    return Exposition(NodeCollector(Reader(str(root / STATE), str(root)),
                                    str(root / TEMPLATES), str(root / CPUS)))


def advance(root: pathlib.Path, states: list[PodState], scrape: int) -> None:
    """What moves between two scrapes of a live node, as the kernel would move it: each
    sandbox's memory charge and its vCPUs' time (so those families are written anew)."""
    for index, state in enumerate(states):
        sandbox = root / CGROUP / state.cgroup.layout.sandbox.lstrip("/")
        (sandbox / "memory.current").write_text(f"{((300 + index) << 20) + scrape * 4096}\n")
        (sandbox / "vcpus" / "cpu.stat").write_text(
            f"usage_usec {vcpu_usec(index) + scrape * 1000}\nuser_usec 0\nsystem_usec 0\n")


def change(root: pathlib.Path, states: list[PodState]) -> None:
    """Every sandbox's state saved anew, as a shim records a guest report and an OOM
    kill: each sandbox.json is parsed again, and two more families written again."""
    for i, state in enumerate(states):
        assert state.vm is not None
        states[i] = state = dataclasses.replace(
            state, vm=dataclasses.replace(state.vm, online_cpus=3 - state.vm.online_cpus),
            guest_oom_kills=state.guest_oom_kills + 1)
        state.save(state_path(str(root / STATE / "k8s.io" / state.sandbox_id)))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sandboxes", type=int, default=100)
    p.add_argument("--scrapes", type=int, default=30)
    p.add_argument("--changing", action="store_true", help="every sandbox's state saved "
                   "anew before each scrape too (untimed, like the memory and vCPU time "
                   "moved before each)")
    args = p.parse_args()
    with fake_node(args.sandboxes) as (root, states):
        scrape = exposition(root).body
        started = time.perf_counter()
        scrape()  # the first: every state parsed, every family written
        first = time.perf_counter() - started
        times, cpu = [], []
        for n in range(args.scrapes):
            advance(root, states, n + 1)
            if args.changing:
                change(root, states)
            started, used = time.perf_counter(), time.process_time()
            body = scrape()
            times.append(time.perf_counter() - started)
            cpu.append(time.process_time() - used)
    times.sort()
    p90 = times[min(len(times) - 1, int(len(times) * 0.9))]
    # CPU time too: on a busy machine the wall clock counts the other processes' turns
    print(f"{args.sandboxes} sandboxes, {args.scrapes} scrapes"
          f"{' of changed states' if args.changing else ''}, {len(body)} bytes: median "
          f"{statistics.median(times) * 1000:.1f} ms, p90 {p90 * 1000:.1f} ms "
          f"(CPU median {statistics.median(cpu) * 1000:.1f} ms; the first scrape "
          f"{first * 1000:.1f} ms); load {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
