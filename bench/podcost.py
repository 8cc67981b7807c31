"""What one pod costs under either runtime, podvm or runc, for bench/pod_bench.py: its CRI
calls timed from this process over one gRPC connection (as kubelet makes them: no client
starting per call), and the host memory it holds once idle, read from its pod cgroup and
its processes. Each pod gets a pod cgroup of its own (`cgroup_parent`, as kubelet gives
every pod one), so that one cgroup holds all that runs for it under either runtime."""
from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

from google.protobuf import json_format

from podvm_core.pb.cri import api_pb2 as cri
from testbed.containerd import Containerd, shims_of
from testbed.criclient import CriClient
from testbed.pods import container_config

RUNTIMES = ("podvm", "runc")
CALL_TIMEOUT = 120.0
MIB = 1 << 20
CGROUP_ROOT = pathlib.Path("/sys/fs/cgroup")
LABELS = {"qemu-system-x86": "QEMU"}
WHAT_RSS_COUNTS = {
    "podvm": "shim + QEMU + virtiofsd (virtiofsd without its shared memory: the guest "
             "RAM it maps is QEMU's, counted there)",
    "runc": "shim + pause (the test's pause image runs busybox sleep) + the container "
            "(a sleep)"}
WHAT_CHARGE_COUNTS = {
    "podvm": "the sandbox cgroup: QEMU, virtiofsd and the shim (sandbox_cgroup_only), "
             "pages they touched after entering it",
    "runc": "pause and sleep; runc's shim runs in containerd's cgroup, not the pod's"}


def runtimes(text: str) -> tuple[str, ...]:
    """--runtimes: a comma-separated list of podvm and runc, each once; its order is the
    order of each round's pods."""
    names = tuple(n.strip() for n in text.split(","))
    unknown = [n for n in names if n not in RUNTIMES]
    if unknown or not names or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(
            f"{text!r}: want podvm, runc or both, comma-separated, each once"
            + (f" (unknown: {', '.join(map(repr, unknown))})" if unknown else ""))
    return names


@dataclass
class PodCost:
    runtime: str
    pod_id: str = ""
    container_id: str = ""
    ready_s: float = 0.0
    """RunPodSandbox's call to its return."""
    running_s: float = 0.0
    """RunPodSandbox's call to StartContainer's return: its one container runs."""
    rss_mib: dict[str, float] = field(default_factory=dict)
    """Resident MiB of the pod's processes once idle, by what they are (summed by kind)."""
    charged_mib: float = 0.0
    """What the host charges the pod cgroup once idle."""
    restored: bool = False
    """podvm: its VM was restored from its shape's template (the shim logged so)."""
    guest_ready_s: float = 0.0
    """podvm: of ready, how long the shim waited for the guest (guest_waits)."""
    guest_container_s: float = 0.0
    """podvm: of the container's create and start, how long the shim waited for the
    guest."""

    @property
    def host_ready_s(self) -> float:
        """Ready less the guest's share: what a node keeps where the guest's steps take
        next to nothing (KVM)."""
        return self.ready_s - self.guest_ready_s

    @property
    def container_s(self) -> float:
        """CreateContainer + StartContainer: ready to the container running."""
        return self.running_s - self.ready_s

    @property
    def host_container_s(self) -> float:
        return self.container_s - self.guest_container_s

    @property
    def rss_total(self) -> float:
        return sum(self.rss_mib.values())


class CriPods:
    """Pods through the CRI from this process: one pod with one container that sleeps."""

    def __init__(self, ctd: Containerd) -> None:
        self.client = CriClient(ctd.cri_endpoint, timeout=CALL_TIMEOUT)

    def start(self, runtime: str, pod: dict, name: str) -> PodCost:
        """The pod and its container started, timed; `pod` is a PodSandboxConfig as crictl
        reads one. On failure the pod is removed."""
        config = json_format.ParseDict(pod, cri.PodSandboxConfig(), ignore_unknown_fields=True)
        container = json_format.ParseDict(container_config(name, "exec sleep 100000"),
                                          cri.ContainerConfig(), ignore_unknown_fields=True)
        cost = PodCost(runtime)
        started = time.monotonic()
        cost.pod_id = self.client.runtime("RunPodSandbox", cri.RunPodSandboxRequest(
            config=config, runtime_handler=runtime)).pod_sandbox_id
        cost.ready_s = time.monotonic() - started
        try:
            cost.container_id = self.client.runtime(
                "CreateContainer", cri.CreateContainerRequest(
                    pod_sandbox_id=cost.pod_id, config=container, sandbox_config=config)
            ).container_id
            self.client.runtime("StartContainer",
                                cri.StartContainerRequest(container_id=cost.container_id))
            cost.running_s = time.monotonic() - started
        except BaseException:
            self.remove(cost.pod_id)
            raise
        return cost

    def remove(self, pod_id: str) -> None:
        self.client.runtime("StopPodSandbox", cri.StopPodSandboxRequest(pod_sandbox_id=pod_id))
        self.client.runtime("RemovePodSandbox",
                            cri.RemovePodSandboxRequest(pod_sandbox_id=pod_id))

    def close(self) -> None:
        self.client.close()


def memory_dir(cgroup: str) -> pathlib.Path:
    """The cgroup's directory in the memory hierarchy (cgroup v1) or the unified one."""
    v1 = CGROUP_ROOT / "memory" / cgroup.strip("/")
    return v1 if (CGROUP_ROOT / "memory").is_dir() else CGROUP_ROOT / cgroup.strip("/")


def charged_bytes(directory: pathlib.Path) -> int:
    """What the host charges the cgroup, its children's pages included (v1 with
    use_hierarchy, as Debian's kernels set it; v2 always)."""
    v1 = directory / "memory.usage_in_bytes"
    return int((v1 if v1.exists() else directory / "memory.current").read_text())


def processes_in(directory: pathlib.Path) -> dict[int, str]:
    """Every process with a thread in the cgroup or below it -> the child of `directory`
    it is in ("" for `directory` itself)."""
    found: dict[int, str] = {}
    for path, _, _ in os.walk(directory):
        child = pathlib.Path(path).relative_to(directory).parts[:1]
        try:
            pids = pathlib.Path(path, "cgroup.procs").read_text().split()
        except OSError:  # a threaded v2 cgroup lists no processes
            continue
        found.update({int(p): child[0] if child else "" for p in pids})
    return found


def status_kib(pid: int) -> dict[str, int]:
    fields = {}
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "RssShmem:")):
            fields[line.split(":")[0]] = int(line.split()[1])
    return fields


def resident_mib(pid: int, kind: str) -> float:
    """VmRSS; virtiofsd's without its shared memory (the guest RAM it maps is QEMU's)."""
    kib = status_kib(pid)
    return (kib["VmRSS"] - (kib.get("RssShmem", 0) if kind == "virtiofsd" else 0)) / 1024


def measure_idle(ctd: Containerd, cost: PodCost, pod_cgroup: str) -> None:
    """The pod's processes' RSS by kind (its shim, wherever it runs, and everything in
    its pod cgroup) and the pod cgroup's charge."""
    directory = memory_dir(pod_cgroup)
    shims = {pid for pid, cmd in shims_of(ctd.address) if cost.pod_id in cmd}
    cgroup_of = processes_in(directory)
    for pid in sorted(shims | set(cgroup_of)):
        try:
            comm = pathlib.Path(f"/proc/{pid}/comm").read_text().strip()
            kind = "shim" if pid in shims else {cost.pod_id: "pause", cost.container_id:
                                                "container"}.get(cgroup_of[pid], comm)
            kind = LABELS.get(kind, kind)
            mib = resident_mib(pid, kind)
        except (OSError, KeyError):  # gone, or a zombie without memory
            continue
        cost.rss_mib[kind] = cost.rss_mib.get(kind, 0.0) + mib
    cost.charged_mib = charged_bytes(directory) / MIB


def describe(cost: PodCost) -> str:
    """One pod's figures, for its line of output."""
    parts = " + ".join(f"{kind} {mib:.1f}" for kind, mib in cost.rss_mib.items())
    return (f"container running {cost.running_s:.2f} s after runp's call; idle: "
            f"RSS {parts} = {cost.rss_total:.1f} MiB, pod cgroup charged "
            f"{cost.charged_mib:.1f} MiB")


def crictl_call(ctd: Containerd) -> float:
    """Seconds of one `crictl version` (testbed/crictl.py) against this containerd:
    what a crictl process adds to the call it makes (it was in every runp figure here
    before the calls were made from this process)."""
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "testbed.crictl", "--runtime-endpoint",
                    ctd.cri_endpoint, "version"], check=True, capture_output=True,
                   cwd=pathlib.Path(__file__).resolve().parents[1])
    return time.monotonic() - started


def ratio(a: float, b: float) -> str:
    return f"{a / b:.1f}x" if b > 0 else "n/a"


def medians(runtime: str, costs: list[PodCost]) -> str:
    """One runtime's figures on their own (its every pod, a template's maker included)."""
    med = statistics.median
    return (f"{runtime:<5} medians of {len(costs)} pods: runp to ready "
            f"{med(c.ready_s for c in costs):.2f} s, runp + create + start to running "
            f"{med(c.running_s for c in costs):.2f} s; idle: RSS "
            f"{med(c.rss_total for c in costs):.1f} MiB, pod cgroup charged "
            f"{med(c.charged_mib for c in costs):.1f} MiB")


def restored_from_template(log: str, pod_id: str) -> bool:
    """Whether the shim logged restoring the pod's VM (shim/vm/machine.py's line): a pod
    that found no template boots, and its template is made in the background, so that
    the pods right after the first may boot too."""
    return f"sandbox {pod_id}: VM restored from template" in log


def guest_waits(log: str, container_id: str) -> float | None:
    """Seconds the shim waited for the guest in the Task API's Create and Start of
    `container_id`, from its lines "container ID created in X, of which the guest G"
    (shim/api/task/service.py, shim/vm/guestclock.py); None when one is missing."""
    waits = []
    for what in ("created", "started"):
        needle = f"container {container_id} {what} in "
        at = log.find(needle)
        if at < 0:
            return None
        line = log[at:log.find("\n", at)]
        waits.append(float(line.split("of which the guest ", 1)[1].split("s", 1)[0]))
    return sum(waits)


def comparison(podvm: list[PodCost], runc: list[PodCost]) -> list[str]:
    """podvm against runc, medians, as lines: podvm's restored pods where there are any
    (every podvm pod in brackets)."""
    compared = [c for c in podvm if c.restored] or podvm
    which = f"podvm's {len(compared)} restored pods" if compared is not podvm else \
        f"all {len(podvm)} podvm pods, none restored"
    med = statistics.median
    lines = [f"podvm against runc, alternated in this run, medians ({which} against "
             f"{len(runc)} runc pods):"]
    for label, get, unit in (("runp to ready", lambda c: c.ready_s, "s"),
                             ("  ready: the host's share", lambda c: c.host_ready_s, "s"),
                             ("runp + create + start to running", lambda c: c.running_s, "s"),
                             ("  create + start", lambda c: c.container_s, "s"),
                             ("  create + start: the host's share",
                              lambda c: c.host_container_s, "s"),
                             ("idle pod: its processes' RSS", lambda c: c.rss_total, "MiB"),
                             ("idle pod: its pod cgroup's charge", lambda c: c.charged_mib,
                              "MiB")):
        p, r = med(get(c) for c in compared), med(get(c) for c in runc)
        line = (f"  {label:<34} podvm {p:7.2f} {unit:<3}  runc {r:7.2f} {unit:<3}  "
                f"podvm/runc {ratio(p, r)}")
        if compared is not podvm:
            every = med(get(c) for c in podvm)
            line += f"   (all {len(podvm)} podvm pods {every:.2f} {unit}, {ratio(every, r)})"
        lines.append(line)
    return lines


def legend(runtimes_run: tuple[str, ...], crictl_s: list[float]) -> list[str]:
    """What each figure counts, in words."""
    lines = ["times: from RunPodSandbox's call, made from this process over one gRPC "
             "connection as kubelet makes them, to RunPodSandbox's return (ready) and "
             "to StartContainer's return (the container, a sleep in the busybox test "
             "image, running; CreateContainer and StartContainer called at once)"]
    if crictl_s:
        lines.append(f"  a crictl process (testbed/crictl.py) adds "
                     f"{statistics.median(crictl_s):.2f} s to a call (median of "
                     f"{len(crictl_s)} `crictl version`, one a round): it was in every "
                     "runp figure of this bench before the calls were made from here")
    lines.append("idle pod: 2 s after its container started, with that one container (the "
                 "idle pod shim and QEMU RSS lines above were of a pod without one before "
                 "runc was beside podvm here)")
    for runtime in runtimes_run:
        lines.append(f"  {runtime} RSS: {WHAT_RSS_COUNTS[runtime]}; shared pages "
                     "(libraries) count in full in each process")
        lines.append(f"  {runtime} pod cgroup charge: {WHAT_CHARGE_COUNTS[runtime]}")
    if (CGROUP_ROOT / "memory").is_dir():
        lines.append("  cgroup v1's memory.usage_in_bytes runs ahead of use by up to the "
                     "kernel's per-CPU charge batch (64 pages a CPU): sub-MiB charges are "
                     "rough")
    return lines
