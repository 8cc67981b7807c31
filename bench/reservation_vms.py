"""The "Mind the Gap" experiment (Liu et al., SoCC '21) with podvm pods: does a pod's VM
get the CPU its pod requested when noisy neighbour VMs share the host?

Every pod is a real podvm VM started through its own shim's Task API (bench/shimpods.py,
no containerd); the bench plays kubelet: it sets each pod cgroup's CPU weight and quota.
- target pod: requests --cpus whole CPUs (limit the same: a guaranteed pod), a VM of that
  many vCPUs. Workloads, one after the other, each for --seconds:
  cpu: one busy shell loop per vCPU. CPU received / requested from the host (CPU time of
    the pod's vCPU threads, its vcpus/ cgroup, over a window inside the run) and in the
    guest (loop iterations per second, against `alone`'s);
  wake: a shell loop that sleeps 1 ms (busybox `read -t` on a FIFO, no fork) and stamps
    each wake-up with $EPOCHREALTIME: how late it wakes, p50 / p99 / p99.9 (the shell's
    own cost per round is in every figure, `alone` included);
  http: busybox httpd in the pod, on a veth in a network namespace of the bench's; one
    client on the host side (in the veth peer's namespace) sends requests back to back,
    a new connection each: rate, p50, p99.
- neighbour pods fill the rest of the host: pairs of "burstable" (a request, no limit)
  and "capped" (limit = request) pods, one pair per 16 CPUs; their requests add up to
  the CPUs the target leaves and are never whole CPUs (podvm would reserve whole ones).
  Together they have --threads-per-cpu vCPUs per host CPU, each VM running two busy
  shell loops per vCPU: they over-commit the host as the paper's worst neighbours did.
- settings: "alone" (no neighbours); "shares" (kubelet's weights from the requests and
  quotas from the limits); "quota" (limits only: every pod capped at its share of the
  host, every weight the same); "exclusive" (podvm's cpu_reservation = "exclusive": the
  target's vCPUs pinned 1:1 on CPUs from podvm's allocator, QEMU's other threads and
  every neighbour on the CPUs left).

Each setting runs --repeat times, interleaved; the table gives medians with ranges
(bench/reservation_table.py), --json every figure (bench/plot_reservation.py draws it).
TCG by default (--accel kvm on a host where KVM works). It refuses a host where the pods
do not fit and says why. Everything it starts is removed at the end, also on Ctrl-C or
SIGTERM; what a killed run left (shims, QEMUs, cgroups, network namespaces with their
taps) is removed by the next run.

usage: sudo python3 bench/reservation_vms.py [--cpus N] [--seconds S] [--repeat R]
                                             [--accel tcg|kvm] [--json FILE]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import pathlib
import platform
import signal
import sys
import time
from dataclasses import dataclass

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import benchcgroups  # noqa: E402
import cgroups  # noqa: E402
import reservation_table  # noqa: E402
import shimpods  # noqa: E402
from reservation_table import Column  # noqa: E402
from shim import config  # noqa: E402
from shim.config import MEASURED_OVERHEAD_MIB  # noqa: E402
from shim.cpus.allocator import Allocator, choose  # noqa: E402
from shim.cpus.cpuset import format_cpu_list, online_cpus  # noqa: E402
from shim.vm.template import maker as templatemaker  # noqa: E402
from vm_workloads import (NEIGHBOUR, PodNetwork, cpu_bound, http_client,  # noqa: E402
                          parse_cpu_bound, parse_wake, sweep_networks, wake_up)

ROOT = pathlib.Path(__file__).resolve().parents[1]
PREFIX = shimpods.PREFIX
SETTINGS = ("alone", "shares", "quota", "exclusive")
GUEST_MIB = 256
DEFAULT_SHARES = 1024
PODS_PER_PAIR_CPUS = 16
COLUMNS = (Column("cpu_host", "CPU recv/req (host)", vs_alone=True),
           Column("cpu_guest", "guest work vs alone"),
           Column("wake_p50_us", "wake p50 µs", digits=0),
           Column("wake_p99_us", "wake p99 µs", digits=0),
           Column("wake_p999_us", "wake p99.9 µs", digits=0, vs_alone=True),
           Column("http_rate", "HTTP req/s", digits=1, vs_alone=True),
           Column("http_p50_ms", "HTTP p50 ms", digits=1),
           Column("http_p99_ms", "HTTP p99 ms", digits=1, vs_alone=True))


class DoesNotFit(Exception):
    """The host cannot hold the pods; the message says why."""


@dataclass(frozen=True)
class PodShape:
    name: str
    request: float
    """CPUs requested (1024 shares each)."""
    limit: float | None
    """CPUs of CFS quota; None: no limit."""
    vcpus: int

    def cpu(self, setting: str) -> tuple[float, float | None]:
        """(request, limit) as the pod's cgroups get them in this setting: "quota" keeps
        the limits alone (a pod without one is capped at its request) and every weight
        at the default."""
        if setting == "quota":
            return 0.0, self.limit or self.request
        return self.request, self.limit


def neighbour_requests(rest: int, pods: int) -> list[float]:
    """`rest` CPUs split over an even number of pods, none a whole number of CPUs (podvm's
    exclusive mode reserves whole ones): each an odd number of half CPUs."""
    if pods % 2 or pods < 2 or pods > 2 * rest:
        raise ValueError(f"{rest} CPUs cannot be split over {pods} pods in odd halves")
    halves = [1] * pods
    for i in range((2 * rest - pods) // 2):
        halves[i % pods] += 2
    return [h / 2 for h in halves]


def shapes(cpus: int, requested: int, threads_per_cpu: int) -> tuple[PodShape,
                                                                     list[PodShape]]:
    """The target and its neighbours on a host of `cpus` CPUs. DoesNotFit when the
    target leaves no CPU for them."""
    rest = cpus - requested
    if requested < 1 or rest < 1:
        raise DoesNotFit(f"the target requests {requested} CPU(s) of the host's {cpus}: it "
                         f"needs at least {requested + 1}, {requested} for the target and "
                         f"1 for its neighbours")
    pods = 2 * math.ceil(rest / PODS_PER_PAIR_CPUS)
    vcpus = max(1, math.ceil(threads_per_cpu * cpus / pods))
    neighbours = [PodShape(f"{'burstable' if i % 2 == 0 else 'capped'}{i // 2 + 1}", r,
                           None if i % 2 == 0 else r, vcpus)
                  for i, r in enumerate(neighbour_requests(rest, pods))]
    return PodShape("target", requested, requested, requested), neighbours


def check_fits(cpus: int, pods: int, accel: str) -> None:
    """DoesNotFit when the pods' memory (guest RAM and QEMU's own) exceeds what the host
    has available now."""
    need = pods * (GUEST_MIB + MEASURED_OVERHEAD_MIB[accel])
    available = next(int(line.split()[1]) // 1024 for line in
                     pathlib.Path("/proc/meminfo").read_text().splitlines()
                     if line.startswith("MemAvailable:"))
    if need > available:
        raise DoesNotFit(f"{pods} pod VMs need {need} MiB ({GUEST_MIB} MiB of guest RAM and "
                         f"{MEASURED_OVERHEAD_MIB[accel]} MiB of QEMU each, accel={accel}); "
                         f"the host has {available} MiB available")


def exclusive_plan(requested: int) -> tuple[str, str]:
    """(the target's CPUs, the rest) as podvm's allocator will choose them now: the rest
    is where QEMU's other threads go (overhead_cpus). DoesNotFit when other pods of the
    node hold so many exclusive CPUs that the target's or the neighbours' do not fit."""
    allocator = Allocator()
    held = allocator.reservations()
    free = allocator.shared_pool()
    if len(free) < requested + 1:
        raise DoesNotFit(f"the target needs {requested} exclusive CPU(s) and its neighbours "
                         f"1 more, but only {format_cpu_list(free) or 'none'} of the node's "
                         f"CPUs are free; held by: " +
                         ", ".join(f"{sid} ({format_cpu_list(c)})" for sid, c in held.items()))
    mine = choose(free, requested, allocator.siblings)
    return format_cpu_list(mine), format_cpu_list(free - set(mine))


def virtio_fs_daemon() -> str:
    """podvm's Rust virtiofsd where it is installed, else the one `make virtiofsd` fetched
    into this checkout (`make bench` does)."""
    installed = config.default_virtio_fs_daemon()
    return installed if os.path.isfile(installed) else \
        str(pathlib.Path(__file__).resolve().parents[1] / "build" / "virtiofsd" / "virtiofsd")


def write_config(path: pathlib.Path, guest: pathlib.Path, accel: str, shape: PodShape,
                 runtime: dict[str, object]) -> pathlib.Path:
    lines = ["[hypervisor.qemu]", f'kernel = "{guest / "vmlinux"}"',
             f'initrd = "{guest / "initrd.img"}"', f'accel = "{accel}"',
             f"default_vcpus = {shape.vcpus}", f"default_maxvcpus = {shape.vcpus}",
             f"default_memory = {GUEST_MIB}", "boot_timeout = 600",
             # the run's own templates and scratch disks, removed with its work directory,
             # and template cgroup (the templates' page cache's stays there: bench() removes it)
             f'template_path = "{path.parent / "templates"}"',
             f'template_cgroup = "{template_cgroup()}"',
             f'scratch_path = "{path.parent / "scratch"}"',
             f'virtio_fs_daemon = "{virtio_fs_daemon()}"']
    if (guest / "rootfs.img").is_file():  # an image whose root is a disk of its own
        lines.append(f'image = "{guest / "rootfs.img"}"')
    lines += ["[runtime]", 'sizing = "max"']
    lines += [f"{key} = {json.dumps(value)}" for key, value in runtime.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def template_cgroup() -> str:
    """The run's template_cgroup (a killed run's is swept with its parents: PREFIX)."""
    return f"/{PREFIX}{os.getpid()}-templates"


class Setting:
    """The pods of one setting under a private parent cgroup; measured, then removed."""

    def __init__(self, run: shimpods.Run, manager: cgroups.CgroupManager, setting: str,
                 rep: int, args: argparse.Namespace, cpus: int) -> None:
        self.run, self.manager, self.setting, self.args = run, manager, setting, args
        self.parent = f"/{PREFIX}{os.getpid()}"
        self.tag = f"{setting}{rep}"
        self.target, neighbours = shapes(cpus, args.cpus, args.threads_per_cpu)
        self.neighbours = [] if setting == "alone" else neighbours
        self.pods: dict[str, shimpods.Pod] = {}
        self.where: dict[str, str] = {}

    def pod_id(self, shape: PodShape) -> str:
        return f"{shape.name}-{self.tag}"

    def pod_cgroup(self, shape: PodShape) -> str:
        return f"{self.parent}/{self.pod_id(shape)}"

    async def boot(self, network: PodNetwork) -> None:
        runtime: dict[str, object] = {}
        if self.setting == "exclusive":
            target_cpus, rest = exclusive_plan(self.target.request)
            runtime = {"cpu_reservation": "exclusive", "enable_vcpus_pinning": True,
                       "overhead_cpus": rest}
            self.where = {"target vCPUs": target_cpus, "the rest": rest}
            # The target first, so that it has its CPUs before the others boot; then
            # one at a time: the rest of the host is small, and boots crowded there
            # under TCG can outlast the guest agent's own deadlines.
            await self._boot(self.target, runtime, network.netns)
            for shape in self.neighbours:
                await self._boot(shape, runtime)
        else:
            booted = await asyncio.gather(
                self._boot(self.target, runtime, network.netns),
                *(self._boot(s, runtime) for s in self.neighbours), return_exceptions=True)
            for outcome in booted:  # raised once every boot has ended: all are stopped
                if isinstance(outcome, BaseException):
                    raise outcome
        benchcgroups.outweigh_the_rest(self.manager, self.parent)
        for shape in [self.target, *self.neighbours]:
            request, limit = shape.cpu(self.setting)
            benchcgroups.set_pod_cpu(self.manager, self.pod_cgroup(shape),
                                     round(request * 1024) or DEFAULT_SHARES, limit)

    async def _boot(self, shape: PodShape, runtime: dict, netns: str = "") -> None:
        """The pod booted; on a failure, booted once more (a loaded host can make a boot
        fail that succeeds a moment later), saying so."""
        config = write_config(self.run.work / f"{self.pod_id(shape)}.toml",
                              self.args.guest_dir, self.args.accel, shape, runtime)
        request, limit = shape.cpu(self.setting)
        for attempt in (1, 2):
            try:
                self.pods[shape.name] = await shimpods.Pod.start(
                    self.run, self.pod_id(shape), config, self.pod_cgroup(shape),
                    shimpods.cri_annotations(request, limit), netns)
                return
            except RuntimeError as exc:
                if attempt == 2:
                    raise
                print(f"{exc}; booting it again", file=sys.stderr, flush=True)

    def vcpu_seconds(self, shape: PodShape) -> float:
        path = cgroups.SandboxLayout(self.pod_cgroup(shape), self.pod_id(shape)).vcpus
        return benchcgroups.cpu_seconds(self.manager, path)

    async def measure(self, network: PodNetwork) -> dict:
        for shape in self.neighbours:
            out = await self.pods[shape.name].start_container("busy", NEIGHBOUR.format(
                loops=2 * shape.vcpus))
            await out.until(b"busy\n", 300)
        target = self.pods["target"]
        figures: dict = {"setting": self.setting}
        figures.update(await self._cpu_bound(target))
        out = await target.start_container("wake", wake_up(self.args.seconds))
        figures.update(parse_wake((await out.until(b"END\n", 120 + 4 * self.args.seconds))
                                  .decode()))
        await target.remove("wake", out)
        figures.update(await self._http(target, network))
        figures["where"] = self.where
        return figures

    async def _cpu_bound(self, target: shimpods.Pod) -> dict:
        """The host's window starts a tenth of the run after the guest says it began and
        ends a tenth before it stops, so that neither end's delay is in it."""
        seconds = self.args.seconds
        out = await target.start_container("cpu", cpu_bound(self.target.vcpus, seconds))
        await out.until(b"go\n", 300)
        await asyncio.sleep(seconds / 10)
        shapes_ = [self.target, *self.neighbours]
        before = [self.vcpu_seconds(s) for s in shapes_]
        start = time.monotonic()
        await asyncio.sleep(seconds * 0.8)
        wall = time.monotonic() - start
        used = [self.vcpu_seconds(s) - b for s, b in zip(shapes_, before)]
        guest = parse_cpu_bound((await out.until(b"END\n", 120 + 2 * seconds)).decode())
        await target.remove("cpu", out)
        neighbours = {s.name: u / wall / s.request for s, u in zip(self.neighbours, used[1:])}
        return {"cpu_host": used[0] / wall / self.target.request, "guest_rate": guest,
                "neighbours": neighbours}

    async def _http(self, target: shimpods.Pod, network: PodNetwork) -> dict:
        out = await target.start_container("web", network.server_script())
        await out.until(b"serving\n", 120)
        try:
            return await http_client(network, self.args.seconds)
        finally:
            await target.remove("web", out)

    async def stop(self) -> None:
        await asyncio.gather(*(pod.stop() for pod in self.pods.values()))
        self.pods.clear()
        benchcgroups.remove_tree(self.manager, self.parent)


def add_guest_ratio(results: list[dict]) -> None:
    """cpu_guest: each result's loop rate against the median rate of `alone`."""
    alone = sorted(r["guest_rate"] for r in results if r["setting"] == "alone")
    base = alone[len(alone) // 2] if alone else None
    for r in results:
        r["cpu_guest"] = r["guest_rate"] / base if base else None


def machine(cpus: int, manager: cgroups.CgroupManager, accel: str) -> dict:
    model = next((line.split(":", 1)[1].strip() for line in
                  pathlib.Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor() or "unknown")
    return {"cpus": cpus, "model": model, "kernel": platform.release(),
            "cgroup": manager.version, "accel": accel}


def loadavg() -> str:
    return " ".join(pathlib.Path("/proc/loadavg").read_text().split()[:3])


async def warm(run: shimpods.Run, args: argparse.Namespace, cpus: int) -> None:
    """Each shape's template made before any pod, as a node's installer does: no pod then
    boots for want of one, and no template is made in the background while the figures
    are taken (shim/vm/template/maker.py). The target has the pod network's NIC."""
    target, neighbours = shapes(cpus, args.cpus, args.threads_per_cpu)
    for shape, nics in [(target, 1), *((n, 0) for n in neighbours)]:
        path = write_config(run.work / f"warm-{shape.name}.toml", args.guest_dir,
                            args.accel, shape, {})
        for outcome in await templatemaker.warm(config.load(str(path)).qemu, [
                templatemaker.Shape(shape.vcpus, GUEST_MIB, nics)]):
            print(f"template of {shape.name}: {outcome.line}", flush=True)


async def bench(args: argparse.Namespace, cpus: int, manager: cgroups.CgroupManager
                ) -> list[dict]:
    results = []
    try:
        await _settings(args, cpus, manager, results)
    finally:
        benchcgroups.remove_tree(manager, template_cgroup())
    add_guest_ratio(results)
    return results


async def _settings(args: argparse.Namespace, cpus: int, manager: cgroups.CgroupManager,
                    results: list[dict]) -> None:
    async with shimpods.Run() as run:
        await warm(run, args, cpus)
        for rep, setting in reservation_table.interleaved(args.settings, args.repeat):
            started = time.monotonic()
            current = Setting(run, manager, setting, rep, args, cpus)
            with PodNetwork(f"{PREFIX}{os.getpid()}") as network:
                try:
                    await current.boot(network)
                    r = await current.measure(network)
                finally:
                    await current.stop()
            r = dict(r, rep=rep, load=loadavg())
            results.append(r)
            neighbours = ", ".join(f"{n} {v:.2f}" for n, v in r["neighbours"].items())
            print(f"{setting} #{rep + 1}: CPU recv/req {r['cpu_host']:.2f}, wake p99.9 "
                  f"{r['wake_p999_us']:.0f} µs ({r['wake_samples']} samples), HTTP "
                  f"{r['http_rate']:.1f} req/s p99 {r['http_p99_ms']:.1f} ms "
                  f"({r['http_timeouts']} timed out); neighbours "
                  f"recv/req {neighbours or '-'}; {time.monotonic() - started:.0f} s, "
                  f"load {r['load']}", flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    intro, _, details = (__doc__ or "").partition("\n\n")
    p = argparse.ArgumentParser(description=intro, epilog=details,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpus", type=int, default=1,
                   help="whole CPUs the target pod requests (default 1)")
    p.add_argument("--seconds", type=float, default=10,
                   help="seconds each target workload runs (default 10)")
    p.add_argument("--repeat", type=int, default=3,
                   help="runs of each setting, interleaved (default 3)")
    p.add_argument("--threads-per-cpu", type=int, default=2,
                   help="neighbours' vCPUs per host CPU (default 2)")
    p.add_argument("--accel", choices=("tcg", "kvm"), default="tcg",
                   help="QEMU's accelerator (default tcg; kvm where it works)")
    p.add_argument("--guest-dir", type=pathlib.Path,
                   default=pathlib.Path(os.environ.get("PODVM_GUEST_DIR")
                                        or ROOT / "build" / "guest"),
                   help="the guest image (default $PODVM_GUEST_DIR, else build/guest)")
    p.add_argument("--settings", nargs="+", choices=SETTINGS, default=list(SETTINGS),
                   help="the settings to run (default all)")
    p.add_argument("--json", metavar="FILE", help="also write every figure to FILE")
    args = p.parse_args(argv)
    args.guest_dir = args.guest_dir.resolve()
    if args.seconds < 1 or args.repeat < 1 or args.threads_per_cpu < 1 or args.cpus < 1:
        p.error("--seconds must be at least 1; --cpus, --repeat and --threads-per-cpu "
                "at least 1")
    return args


def refusal(args: argparse.Namespace, cpus: int) -> str | None:
    """Why this host cannot run the bench, or None."""
    if os.geteuid() != 0:
        return "needs root (it makes cgroups, network namespaces and pods)"
    try:
        target, neighbours = shapes(cpus, args.cpus, args.threads_per_cpu)
        check_fits(cpus, 1 + len(neighbours), args.accel)
        if "exclusive" in args.settings:
            exclusive_plan(args.cpus)
    except DoesNotFit as exc:
        return str(exc)
    missing = [str(args.guest_dir / f) for f in ("vmlinux", "initrd.img")
               if not (args.guest_dir / f).is_file()]
    if missing:
        return f"no guest image: {', '.join(missing)} missing (make guest)"
    if not os.path.exists(shimpods.SHIM):
        return f"no shim at {shimpods.SHIM} (make venv)"
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cpus = len(online_cpus())
    manager = cgroups.detect()
    if os.geteuid() == 0:  # what killed runs left goes first: it may be what does not fit
        shimpods.sweep_stale()
        benchcgroups.sweep_stale(manager, PREFIX)
        sweep_networks(PREFIX)
    why = refusal(args, cpus)
    if why:
        print(f"reservation_vms.py: {why}", file=sys.stderr)
        return 1
    target, neighbours = shapes(cpus, args.cpus, args.threads_per_cpu)
    print(f"machine: {cpus} CPUs ({machine(cpus, manager, args.accel)['model']}), kernel "
          f"{platform.release()}, cgroup v{manager.version}, accel={args.accel}, load "
          f"{loadavg()}")
    print(f"target requests {target.request} CPU(s), {target.vcpus} vCPU(s); neighbours: " +
          ", ".join(f"{n.name} {n.request:g} CPUs "
                    f"({'no limit' if n.limit is None else f'limit {n.limit:g}'}), "
                    f"{n.vcpus} vCPUs" for n in neighbours) +
          f"; {args.seconds:g} s per workload, {args.repeat} run(s) of each setting",
          flush=True)
    loop = asyncio.new_event_loop()
    task = loop.create_task(bench(args, cpus, manager))
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, task.cancel)
    try:
        results = loop.run_until_complete(task)
    except asyncio.CancelledError:
        print("reservation_vms.py: interrupted; what it started is removed", file=sys.stderr)
        return 130
    except (RuntimeError, TimeoutError, cgroups.CgroupError) as exc:
        print(f"reservation_vms.py: {exc}; what it started is removed", file=sys.stderr)
        return 1
    finally:
        loop.close()
    print(reservation_table.table(results, COLUMNS), flush=True)
    if args.json:
        reservation_table.write_json(args.json, reservation_table.document(
            machine(cpus, manager, args.accel),
            {k: str(v) if isinstance(v, pathlib.Path) else v for k, v in vars(args).items()},
            COLUMNS, results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
