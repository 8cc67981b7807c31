"""How many idle pods a host holds: N idle default pods (1 vCPU, 256 MiB) started through
the CRI on a private containerd, then, per pod and as medians, the memory charged to its
sandbox cgroup, QEMU's RSS split into anonymous and file pages, the shim's RSS, the CPU
the idle pod burns (its sandbox cgroup, percent of one CPU over the window), and the
runp-to-ready time of the last pod. QEMU's memory is split (from its smaps) into the
guest's RAM (shared memory since virtio-fs: a memfd), the TCG translation cache and the
rest (malloc arenas, heap); the pod's virtiofsd is counted by its anonymous memory (the
guest RAM it maps is QEMU's).

Target (issue 15): an idle default pod <= 160 MiB charged to its sandbox cgroup under TCG,
runp to ready <= 3 s.

usage: python bench/density.py [N] [--accel tcg|kvm] [--window SECONDS]
                               [--scratch-disk-mib MIB]
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import statistics
import sys
import tempfile
import time

import psutil

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from shim.config import HypervisorConfig  # noqa: E402
from testbed.containerd import Containerd, shims_of  # noqa: E402
from testbed.cri import Crictl, write_config  # noqa: E402
from testbed.pods import pod_config, pod_qemus  # noqa: E402
from testbed.vmconfig import warm_templates, write_test_config  # noqa: E402

MIB = 1 << 20
CGROUP_ROOT = "/sys/fs/cgroup"
SANDBOX_PREFIX = "podvm_"
# What one idle TCG pod needs here, host side, with room: sets the default N.
POD_BUDGET_MIB = 256 + 160


@dataclasses.dataclass
class PodFigures:
    name: str
    ready_s: float
    charged_mib: float = 0.0
    qemu_anon_mib: float = 0.0
    qemu_file_mib: float = 0.0
    files_anon_mib: float = 0.0
    guest_ram_mib: float = 0.0
    tcg_cache_mib: float = 0.0
    shim_rss_mib: float = 0.0
    idle_cpu_pct: float = 0.0
    qemu_cpu_pct: float = 0.0


def process_cpu_s(pid: int) -> float:
    """utime + stime of a whole process (all its threads), seconds."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def status_kib(pid: int, field: str) -> int:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(f"no {field} in /proc/{pid}/status")


def anon_split_kib(pid: int, ram_mib: int = 256) -> tuple[int, int]:
    """Resident KiB of the guest RAM (the mapping as big as the VM's memory: anonymous
    before virtio-fs, a shared memfd since) and of the TCG translation cache (QEMU's
    anonymous executable mappings)."""
    ram = tcg = 0
    size = perms = name = None
    for line in pathlib.Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if not fields[0].endswith(":"):  # a mapping's header: range perms offset dev inode [name]
            low, high = (int(x, 16) for x in fields[0].split("-"))
            size, perms, name = high - low, fields[1], fields[5:]
        elif fields[0] == "Anonymous:" and not name and "x" in perms:
            tcg += int(fields[1])
        elif fields[0] == "Rss:" and size == ram_mib * MIB and \
                (not name or name[0].startswith("/memfd:")):
            ram += int(fields[1])
    return ram, tcg


def sandbox_cgroups(pid: int) -> dict[str, str]:
    """Controller (v1) or "" (v2) -> the directory of the sandbox cgroup holding `pid`
    (its threads may sit in the vcpus/ or vmm/ children)."""
    found = {}
    for line in pathlib.Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        parts = path.split("/")
        cut = next((i for i, p in enumerate(parts) if p.startswith(SANDBOX_PREFIX)), None)
        if cut is None:
            continue
        sandbox = "/".join(parts[:cut + 1])
        for controller in controllers.split(",") if controllers else [""]:
            base = CGROUP_ROOT if controller == "" else f"{CGROUP_ROOT}/{controller}"
            found[controller] = base + sandbox
    return found


def charged_bytes(groups: dict[str, str]) -> int:
    if "memory" in groups:
        return int(pathlib.Path(groups["memory"], "memory.usage_in_bytes").read_text())
    return int(pathlib.Path(groups[""], "memory.current").read_text())


def cpu_usec(groups: dict[str, str]) -> float:
    if "cpuacct" in groups:
        return int(pathlib.Path(groups["cpuacct"], "cpuacct.usage").read_text()) / 1000
    for line in pathlib.Path(groups[""], "cpu.stat").read_text().splitlines():
        if line.startswith("usage_usec "):
            return int(line.split()[1])
    raise KeyError("no usage_usec in cpu.stat")


def default_pods() -> int:
    """As many as fit the memory available now, at most two per CPU (idle TCG pods tick)."""
    available = status_meminfo("MemAvailable") // 1024
    return max(1, min(available // POD_BUDGET_MIB, 2 * (os.cpu_count() or 1)))


def status_meminfo(field: str) -> int:
    for line in pathlib.Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def measure(pods: list[PodFigures], pids: dict[str, tuple[int, int]], window: float) -> None:
    groups = {name: sandbox_cgroups(qemu) for name, (qemu, _) in pids.items()}
    before = {name: cpu_usec(g) for name, g in groups.items()}
    qemu_before = {name: process_cpu_s(qemu) for name, (qemu, _) in pids.items()}
    started = time.monotonic()
    time.sleep(window)
    spent = time.monotonic() - started
    for pod in pods:
        qemu, shim = pids[pod.name]
        g = groups[pod.name]
        pod.idle_cpu_pct = (cpu_usec(g) - before[pod.name]) / (spent * 1e6) * 100
        pod.qemu_cpu_pct = (process_cpu_s(qemu) - qemu_before[pod.name]) / spent * 100
        pod.charged_mib = charged_bytes(g) / MIB
        pod.qemu_anon_mib = status_kib(qemu, "RssAnon") / 1024
        pod.qemu_file_mib = (status_kib(qemu, "RssFile") + status_kib(qemu, "RssShmem")) / 1024
        ram, tcg = anon_split_kib(qemu)
        pod.guest_ram_mib, pod.tcg_cache_mib = ram / 1024, tcg / 1024
        pod.shim_rss_mib = status_kib(shim, "VmRSS") / 1024
        pod.files_anon_mib = sum(status_kib(p.pid, "RssAnon") for p in file_servers(shim)) / 1024


def file_servers(shim: int) -> list[psutil.Process]:
    """The pod's virtiofsd: the shim's child, and the child it serves from."""
    found = [p for p in psutil.Process(shim).children(recursive=True)
             if p.name() == "virtiofsd"]
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pods", type=int, nargs="?", default=default_pods(),
                        help="idle pods to start (default: what fits this machine)")
    parser.add_argument("--accel", default="tcg")
    parser.add_argument("--window", type=float, default=30.0,
                        help="seconds over which idle CPU is measured")
    parser.add_argument("--scratch-disk-mib", type=int,
                        default=HypervisorConfig.scratch_disk_mib,
                        help="the pods' scratch disk (scratch_disk_mib; 0: none)")
    parser.add_argument("--settle", type=float, default=10.0,
                        help="seconds the last pod idles before measuring")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="podvm-density-") as tmp:
        work = pathlib.Path(tmp)
        config = write_test_config(work / "podvm.toml", accel=args.accel,
                                   scratch_disk_mib=args.scratch_disk_mib,
                                   template_path=str(work / "templates"))
        warm_templates(config)
        with Containerd(work / "containerd", namespace="podvm-density", cri=True,
                        podvm_config=config) as ctd:
            ctd.import_cri_images(work)
            crictl = Crictl(ctd.cri_endpoint, timeout="120s")
            pods: list[PodFigures] = []
            pids: dict[str, tuple[int, int]] = {}
            ids = []
            try:
                for i in range(args.pods):
                    name = f"d{i}"
                    pod_file = write_config(work, f"{name}.json", pod_config(ctd, work, name))
                    started = time.monotonic()
                    pod_id = crictl.runp(pod_file, runtime="podvm")
                    ids.append(pod_id)
                    pods.append(PodFigures(name, time.monotonic() - started))
                    (qemu,) = pod_qemus(pod_id)
                    (shim,) = [pid for pid, cmd in shims_of(ctd.address) if pod_id in cmd]
                    pids[name] = (qemu, shim)
                    print(f"pod {name}: runp to ready {pods[-1].ready_s:.2f} s", flush=True)
                time.sleep(args.settle)
                measure(pods, pids, args.window)
            finally:
                for pod_id in ids:
                    crictl.run("stopp", pod_id, check=False)
                    crictl.run("rmp", pod_id, check=False)
    report(pods, args)
    return 0


COLUMNS = (("charged MiB", "charged_mib"), ("QEMU anon MiB", "qemu_anon_mib"),
           ("  guest RAM", "guest_ram_mib"), ("  TCG cache", "tcg_cache_mib"),
           ("QEMU file MiB", "qemu_file_mib"), ("shim RSS MiB", "shim_rss_mib"),
           ("virtiofsd anon", "files_anon_mib"),
           ("idle CPU %", "idle_cpu_pct"), ("  of it QEMU", "qemu_cpu_pct"),
           ("ready s", "ready_s"))


def report(pods: list[PodFigures], args: argparse.Namespace) -> None:
    print(f"{len(pods)} idle default pods (1 vCPU, 256 MiB), accel={args.accel}, "
          f"idle CPU over {args.window:g} s")
    print(f"{'pod':<8}" + "".join(f"{title:>15}" for title, _ in COLUMNS))
    for pod in pods:
        print(f"{pod.name:<8}" + "".join(f"{getattr(pod, key):>15.1f}" for _, key in COLUMNS))
    print(f"{'median':<8}" + "".join(
        f"{statistics.median(getattr(p, key) for p in pods):>15.1f}" for _, key in COLUMNS))
    print(f"runp to ready of the last pod: {pods[-1].ready_s:.2f} s   "
          f"target: <= 160 MiB charged, <= 3 s ready (TCG)")


if __name__ == "__main__":
    sys.exit(main())
