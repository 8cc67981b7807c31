"""Twenty pods at once (issue 30, items 3 and 4): N pods of a few shapes started
concurrently through the CRI, as kubelet starts them after a node reboot or a rollout,
then all stopped and removed at once. Runs on a private containerd like the tests.

Each pod is started by a thread of its own doing RunPodSandbox, CreateContainer and
StartContainer over one gRPC channel (kubelet's calls, without a crictl process per call
taking the CPUs the pods need). Printed: every pod's runp to ready and to its container
running (p50, p90, max), the host memory charged to each sandbox cgroup and in total, the
CPU seconds the shims, QEMUs and virtiofsds spent starting, where the time of a start went
(bench/pod_bench.py's phases, from the shims' lines in containerd's log), how long the
teardown and each `shim delete` took, and what was left (it must be nothing).

With templates on (the default), the first pod of the template's shape boots and saves it
while the others boot beside it: the phases show whether any of them waited.

tests/e2e/test_scale.py runs `run_scale` with 5 pods and asserts completeness.

usage: python bench/scale.py [--pods N] [--shapes V:M,...] [--accel tcg|kvm] [--cold]
                             [--boot-timeout S] [--keep-log FILE]
Exits 1 when a pod failed or anything was left.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import re
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from google.protobuf import json_format  # noqa: E402

import cgroups  # noqa: E402
from bench.pod_bench import PHASES, annotations, phases, sizes  # noqa: E402
from podvm_core.pb.cri import api_pb2 as cri  # noqa: E402
from podvm_node.collect import Reader  # noqa: E402
from shim.host import paths  # noqa: E402
from shim.host.cleanup import processes_of  # noqa: E402
from shim.host.podstate import PodState, PodStateError, state_path  # noqa: E402
from testbed.containerd import CRI_NAMESPACE, Containerd, shims_of  # noqa: E402
from testbed.criclient import CriClient  # noqa: E402
from testbed.pods import container_config, pod_config, podvm_leftovers, qemus  # noqa: E402
from testbed.vmconfig import warm_templates, write_test_config  # noqa: E402

SHAPES = "1:256,2:640,1:384"
CALL_TIMEOUT = 600.0
"""Seconds one CRI call may take: twenty TCG guests booting on two CPUs take minutes."""
KILLED_DELETE = 'msg="failed to delete" '
"""containerd's line for a `shim delete` that failed or that it killed at its limit."""
DELETE_LINE = re.compile(r"shim delete of (\S+) done in ([0-9.]+)s, ([0-9.]+)s since exec")
"""The line shim/contract/delete.py writes (containerd logs it as its stderr)."""


@dataclass
class PodRun:
    name: str
    shape: tuple[int, int]
    pod_id: str = ""
    container_id: str = ""
    ready_s: float = 0.0
    """RunPodSandbox's call to its return: the pod is ready."""
    running_s: float = 0.0
    """RunPodSandbox's call to StartContainer's return: its container runs."""
    error: str = ""
    memory_bytes: int | None = None
    removed_s: float = 0.0
    cgroups: list[str] = field(default_factory=list)


@dataclass
class ScaleRun:
    pods: list[PodRun]
    start_s: float = 0.0
    cpu_s: dict[str, float] = field(default_factory=dict)
    teardown_s: float = 0.0
    teardown_errors: list[str] = field(default_factory=list)
    left: list[str] = field(default_factory=list)
    phases: dict[str, list[float]] = field(default_factory=dict)
    killed_deletes: list[str] = field(default_factory=list)
    swept: list[int] = field(default_factory=list)
    """Per `delete` that swept: how many sandboxes' stale state it removed."""
    restored: int = 0
    templates_made: list[str] = field(default_factory=list)
    deletes: list[tuple[float, float, float]] = field(default_factory=list)
    """Each `shim delete` containerd ran: bench/scale.py's shim_deletes."""

    @property
    def failed(self) -> list[PodRun]:
        return [p for p in self.pods if p.error]


def cpu_seconds(pid: int) -> float:
    """utime + stime of `pid` (0 when gone)."""
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pod_processes(ctd: Containerd, pods: list[PodRun]) -> dict[int, str]:
    """pid -> role (shim, qemu, virtiofsd) of the processes of this containerd's pods."""
    found = {pid: "shim" for pid, cmd in shims_of(ctd.address) if "podvm" in cmd}
    found.update({pid: "qemu" for pid in qemus(ctd.cgroup_parent)})
    for pod in pods:
        if pod.pod_id:
            state_dir = paths.state_dir(CRI_NAMESPACE, pod.pod_id)
            found.update({pid: "virtiofsd" for pid in processes_of("virtiofsd", state_dir + "/")})
    return found


def cpu_by_role(processes: dict[int, str], before: dict[int, float]) -> dict[str, float]:
    spent: dict[str, float] = {}
    for pid, role in processes.items():
        spent[role] = spent.get(role, 0.0) + cpu_seconds(pid) - before.get(pid, 0.0)
    return spent


def start_pod(client: CriClient, ctd: Containerd, work: pathlib.Path, pod: PodRun) -> None:
    """What kubelet does for a new pod: its sandbox, then its one container (a long sleep
    in the test image), started."""
    config = json_format.ParseDict(
        pod_config(ctd, work, pod.name, annotations=annotations(pod.shape)),
        cri.PodSandboxConfig(), ignore_unknown_fields=True)
    container = json_format.ParseDict(container_config(pod.name, "exec sleep 100000"),
                                      cri.ContainerConfig(), ignore_unknown_fields=True)
    started = time.monotonic()
    try:
        pod.pod_id = client.runtime("RunPodSandbox", cri.RunPodSandboxRequest(
            config=config, runtime_handler="podvm")).pod_sandbox_id
        pod.ready_s = time.monotonic() - started
        pod.container_id = client.runtime("CreateContainer", cri.CreateContainerRequest(
            pod_sandbox_id=pod.pod_id, config=container, sandbox_config=config)).container_id
        client.runtime("StartContainer",
                       cri.StartContainerRequest(container_id=pod.container_id))
        pod.running_s = time.monotonic() - started
    except Exception as exc:  # noqa: BLE001 - every pod's outcome is reported
        pod.error = f"{type(exc).__name__}: {exc}"


def check_running(client: CriClient, pod: PodRun) -> None:
    """A started pod must read SANDBOX_READY and its container CONTAINER_RUNNING."""
    if pod.error:
        return
    sandbox = client.runtime("PodSandboxStatus",
                             cri.PodSandboxStatusRequest(pod_sandbox_id=pod.pod_id))
    status = client.runtime("ContainerStatus",
                            cri.ContainerStatusRequest(container_id=pod.container_id))
    if sandbox.status.state != cri.SANDBOX_READY:
        pod.error = f"sandbox state {cri.PodSandboxState.Name(sandbox.status.state)}"
    elif status.status.state != cri.CONTAINER_RUNNING:
        pod.error = f"container state {cri.ContainerState.Name(status.status.state)}"


def measure_pod(reader: Reader, pod: PodRun) -> None:
    """The memory its sandbox cgroup is charged, and that cgroup's directories (they must
    be gone after the teardown)."""
    if not pod.pod_id:
        return
    state_dir = paths.state_dir(CRI_NAMESPACE, pod.pod_id)
    found = reader.read(state_dir)
    pod.memory_bytes = found.memory_bytes if found is not None else None
    try:
        state = PodState.load(state_path(state_dir))
    except (OSError, PodStateError):
        return
    manager = cgroups.manager_from_state(dict(state.cgroup.manager))
    hierarchies = getattr(manager, "hierarchies", None) or [manager.hierarchy]
    pod.cgroups = [h.directory(state.cgroup.layout.sandbox) for h in hierarchies]


def remove_pod(client: CriClient, pod: PodRun, tries: int = 3) -> str:
    """StopPodSandbox and RemovePodSandbox, tried again after a failure as kubelet does;
    the errors, if any (reported even when a later try removed the pod)."""
    if not pod.pod_id:
        return ""
    started = time.monotonic()
    errors = []
    for _ in range(tries):
        try:
            client.runtime("StopPodSandbox",
                           cri.StopPodSandboxRequest(pod_sandbox_id=pod.pod_id))
            client.runtime("RemovePodSandbox",
                           cri.RemovePodSandboxRequest(pod_sandbox_id=pod.pod_id))
            break
        except Exception as exc:  # noqa: BLE001
            errors.append(f"{pod.name}: {type(exc).__name__}: {exc}")
    pod.removed_s = time.monotonic() - started
    return "; ".join(errors)


def leftovers(ctd: Containerd, pods: list[PodRun], timeout: float = 120) -> list[str]:
    """What the removed pods left (waiting up to `timeout` for their shims to exit): shim,
    QEMU, virtiofsd, mounts, state directory, socket, sandbox cgroup."""
    deadline = time.monotonic() + timeout
    while True:
        left = [f"{pod.name}: {what}" for pod in pods if pod.pod_id
                for what in podvm_leftovers(ctd, pod.pod_id)]
        left += [f"{pod.name}: cgroup {d}" for pod in pods for d in pod.cgroups
                 if os.path.isdir(d)]
        left += [f"qemu {pid}" for pid in qemus(ctd.cgroup_parent)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def shim_deletes(log: str, pods: list[PodRun]) -> list[tuple[float, float, float]]:
    """Each of the pods' `shim delete` runs: (seconds in its cleanup, since its exec, and
    from containerd's "cleaning up after shim disconnected" to its stderr line in
    containerd's log: what containerd's 5 s limit counts). A delete containerd killed
    writes no line (it shows as 'failed to delete')."""
    ids = {p.pod_id for p in pods} | {p.container_id for p in pods}
    began: dict[str, float] = {}
    found = []
    for line in log.splitlines():
        if "cleaning up after shim disconnected" in line:
            ident = re.search(r" id=(\S+)", line)
            if ident:
                began[ident.group(1)] = _stamp(line)
        elif (m := DELETE_LINE.search(line)) and m.group(1) in ids:
            start = began.pop(m.group(1), None)
            found.append((float(m.group(2)), float(m.group(3)),
                          _stamp(line) - start if start is not None else float("nan")))
    return found


def _stamp(line: str) -> float:
    """Seconds of the day of containerd's time="...Z" at the start of `line`."""
    hms = line.split('"', 2)[1].split("T", 1)[1].rstrip("Z")
    h, m, sec = hms.split(":")
    return int(h) * 3600 + int(m) * 60 + float(sec)


def pod_phases(log_lines: list[str], pod: PodRun) -> list[float]:
    """bench/pod_bench.py's phases of one pod, timed from its own RunPodSandbox line (with
    twenty pods at once, the latest call before its shim's first line may be another's)."""
    own = [ln for ln in log_lines if pod.pod_id in ln or
           ("RunPodSandbox for" in ln and f"Name:{pod.name}," in ln)]
    return phases("\n".join(own), pod.pod_id)


def template_use(log: str, pods: list[PodRun]) -> tuple[int, list[str]]:
    """How many of the pods restored a template, and the templates made during the run
    (shim/vm/template/template.py's lines)."""
    restored = sum(1 for p in pods if p.pod_id and
                   f"sandbox {p.pod_id}: VM restored from template" in log)
    made = re.findall(r"template (\w+) made by sandbox \w+ in ([0-9.]+s)", log)
    return restored, [f"{key[:8]} in {took}" for key, took in made]


def run_scale(ctd: Containerd, work: pathlib.Path, count: int,
              shapes: list[tuple[int, int]], warm: bool = True) -> ScaleRun:
    """Start `count` pods at once on the started CRI containerd `ctd`, measure them, remove
    them all at once, and see what is left. `warm`: the default shape's template is made
    first, as the node installer has it made (`podvmctl templates warm`); else the first
    pods of every shape boot."""
    tag = f"scale-{uuid.uuid4().hex[:6]}"
    if warm:
        warm_templates(pathlib.Path(ctd.podvm_config))
    run = ScaleRun([PodRun(f"{tag}-{i}", shapes[i % len(shapes)]) for i in range(count)])
    before = {pid: cpu_seconds(pid) for pid in pod_processes(ctd, [])}
    log_from = len(ctd.log())
    with CriClient(ctd.cri_endpoint, timeout=CALL_TIMEOUT) as client, \
            ThreadPoolExecutor(max_workers=count) as pool:
        started = time.monotonic()
        list(pool.map(lambda p: start_pod(client, ctd, work, p), run.pods))
        run.start_s = time.monotonic() - started
        run.cpu_s = cpu_by_role(pod_processes(ctd, run.pods), before)
        reader = Reader()
        for pod in run.pods:
            check_running(client, pod)
            measure_pod(reader, pod)
        started = time.monotonic()
        errors = list(pool.map(lambda p: remove_pod(client, p), run.pods))
        run.teardown_s = time.monotonic() - started
    run.teardown_errors = [e for e in errors if e]
    run.left = leftovers(ctd, run.pods)
    log = ctd.log()[log_from:]
    lines = log.splitlines()
    spent = [pod_phases(lines, p) for p in run.pods if p.pod_id]
    run.phases = {name: [s[k] for s in spent if s] for k, (name, _) in enumerate(PHASES)}
    run.deletes = shim_deletes(log, run.pods)
    run.restored, run.templates_made = template_use(log, run.pods)
    run.swept = [int(n) for n in re.findall(r"swept the state of (\d+) sandboxes", log)]
    run.killed_deletes = [line.strip()[:400] for line in log.splitlines()
                          if KILLED_DELETE in line]
    return run


def spread(values: list[float]) -> str:
    if not values:
        return "none"
    ordered = sorted(values)
    p90 = ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]
    return (f"p50 {statistics.median(ordered):.2f} s, p90 {p90:.2f} s, "
            f"max {ordered[-1]:.2f} s")


def report(run: ScaleRun) -> str:
    lines = []
    for pod in run.pods:
        mem = f"{pod.memory_bytes / 2**20:.0f} MiB" if pod.memory_bytes else "?"
        lines.append(f"{pod.name} {pod.shape[0]}:{pod.shape[1]}  ready {pod.ready_s:6.2f} s  "
                     f"running {pod.running_s:6.2f} s  charged {mem:>8}  "
                     f"removed in {pod.removed_s:5.2f} s  {pod.error or 'ok'}")
    ok = [p for p in run.pods if not p.error]
    lines.append(f"{len(run.pods)} pods at once: all started in {run.start_s:.2f} s, "
                 f"{len(run.failed)} failed")
    lines.append(f"templates            {run.restored} pods restored one; made during the "
                 f"run: {', '.join(run.templates_made) or 'none'}")
    lines.append(f"runp to ready        {spread([p.ready_s for p in ok])}")
    lines.append(f"to container running {spread([p.running_s for p in ok])}")
    charged = [p.memory_bytes for p in ok if p.memory_bytes]
    if charged:
        lines.append(f"memory charged       per pod median {statistics.median(charged) / 2**20:.0f}"
                     f" MiB, max {max(charged) / 2**20:.0f} MiB, total "
                     f"{sum(charged) / 2**20:.0f} MiB")
    for shape in sorted({p.shape for p in ok}):
        of = [p for p in ok if p.shape == shape]
        lines.append(f"  {shape[0]} vCPU {shape[1]:4} MiB  ready {spread([p.ready_s for p in of])}")
    lines.append("CPU during the start " + ", ".join(
        f"{role} {s:.1f} s" for role, s in sorted(run.cpu_s.items()))
        + f" (total {sum(run.cpu_s.values()):.1f} s over {run.start_s:.1f} s wall)")
    medians = {name: statistics.median(v) for name, v in run.phases.items() if v}
    total = sum(medians.values()) or 1.0
    lines.append("phases (median)      " + ", ".join(
        f"{name} {s:.2f} s ({100 * s / total:.0f}%)" for name, s in medians.items()))
    to_qemu = [a + b for a, b in zip(*list(run.phases.values())[:2])]
    lines.append(f"runp to QEMU started {spread(to_qemu)} (a lock before the boot would "
                 "spread these)")
    if medians:
        slowest = max(medians, key=medians.__getitem__)
        lines.append(f"slowest step         {slowest}: {100 * medians[slowest] / total:.0f}% "
                     f"of a start (max over pods {max(run.phases[slowest]):.2f} s)")
    lines.append(f"teardown (all at once) {run.teardown_s:.2f} s; stopp+rmp per pod "
                 f"{spread([p.removed_s for p in run.pods if p.pod_id])}")
    lines.append(f"shim delete          {len(run.deletes)} runs: its cleanup "
                 f"{spread([d[0] for d in run.deletes])}")
    lines.append(f"  since its exec     {spread([d[1] for d in run.deletes])}")
    lines.append(f"  as containerd sees {spread([d[2] for d in run.deletes if d[2] == d[2]])}"
                 " (containerd kills it at 5 s)")
    lines += [f"teardown error: {e}" for e in run.teardown_errors]
    lines.append(f"shim deletes killed or failed: {len(run.killed_deletes)}; stale sandbox "
                 f"states swept by later deletes: {sum(run.swept)}")
    lines += [f"  {line}" for line in run.killed_deletes]
    lines.append("left: " + ("nothing" if not run.left else "; ".join(run.left)))
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pods", type=int, default=20)
    parser.add_argument("--shapes", default=SHAPES, type=sizes,
                        help=f"vCPUs:MiB of the pods in turn (default {SHAPES})")
    parser.add_argument("--accel", default="tcg")
    parser.add_argument("--boot-timeout", type=int, default=600,
                        help="seconds a guest may take to come up (boot_timeout; default 600: "
                        "twenty TCG guests booting at once on two CPUs take minutes)")
    parser.add_argument("--cold", action="store_true",
                        help="no template made first (podvmctl templates warm, as the node "
                             "installer runs it): the first pods of every shape boot")
    parser.add_argument("--keep-log", type=pathlib.Path, metavar="FILE",
                        help="copy containerd's log (the shims' lines included) to FILE")
    args = parser.parse_args()
    if args.pods < 1:
        parser.error("--pods: at least 1")
    with tempfile.TemporaryDirectory(prefix="podvm-scale-") as tmp:
        work = pathlib.Path(tmp)
        config = write_test_config(work / "podvm.toml", accel=args.accel,
                                   template_path=str(work / "templates"),
                                   boot_timeout=args.boot_timeout,
                                   enable_annotations=("default_vcpus", "default_memory"))
        with Containerd(work / "containerd", namespace="podvm-scale", cri=True,
                        podvm_config=config) as ctd:
            ctd.import_cri_images(work)
            run = run_scale(ctd, work, args.pods, args.shapes, warm=not args.cold)
            if args.keep_log:
                shutil.copyfile(ctd.log_path, args.keep_log)
        forced = ctd.forced
    print(report(run))
    if forced:
        print("containerd's stop had to force: " + "; ".join(forced))
    return 1 if run.failed or run.left or run.teardown_errors or forced else 0


if __name__ == "__main__":
    sys.exit(main())
