"""Twenty pods at once (issue 30, items 3 and 4; issue 47): N pods of a few shapes started
concurrently through the CRI, as kubelet starts them after a node reboot or a rollout,
then all stopped and removed at once; then as many runc pods on the same containerd, for a
reference. Runs on a private containerd like the tests.

Each pod is started by a thread of its own doing RunPodSandbox, CreateContainer and
StartContainer over one gRPC channel (kubelet's calls, without a crictl process per call
taking the CPUs the pods need). Printed: every pod's runp to ready and to its container
running (p50, p90, max), the host memory charged to each sandbox cgroup and in total, the
CPU seconds the shims, QEMUs and virtiofsds spent starting, where the time of a start went
(bench/pod_bench.py's phases, from the shims' lines in containerd's log), how long the
removal of all of them and each `shim delete` took, any `shim delete` containerd killed at
its 5 s limit or saw fail, and what was left (it must be nothing).

Beside runc (--runtimes podvm,runc, the default): once podvm's pods are removed, the same
N pods (same image, same container, one thread each) run under runc and are removed at
once; the two runtimes' starts, removals and leftovers are printed side by side
(bench/scalepods.py has what a pod of either is and leaves).

With templates on (the default), the first pod of the template's shape boots and saves it
while the others boot beside it: the phases show whether any of them waited.

tests/e2e/test_scale.py runs `run_scale` with 5 podvm pods and asserts completeness.

usage: python bench/scale.py [--pods N] [--shapes V:M,...] [--accel tcg|kvm] [--cold]
                             [--boot-timeout S] [--scratch-disk-mib MIB] [--keep-log FILE]
                             [--runtimes podvm,runc]
Exits 1 when a pod failed, a `shim delete` was killed or failed, or anything was left.
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
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench.pod_bench import PHASES, sizes  # noqa: E402
from bench.podcost import RUNTIMES, runtimes  # noqa: E402
from bench.scalepods import (PodRun, check_running, leftovers, measure_pod,  # noqa: E402
                             remove_pod, removal_wall, start_pod)
from bench.scalelog import (Deletes, past_deadline, pod_phases,  # noqa: E402
                            read_deletes, removal_medians, template_use,
                            unattributed_failures)
from podvm_node.collect import Reader  # noqa: E402
from shim.host import paths  # noqa: E402
from shim.host.cleanup import processes_of  # noqa: E402
from testbed import forkservers  # noqa: E402
from testbed.containerd import CRI_NAMESPACE, Containerd, shims_of  # noqa: E402
from testbed.criclient import CriClient  # noqa: E402
from testbed.pods import qemus  # noqa: E402
from testbed.vmconfig import warm_templates, write_test_config  # noqa: E402

SHAPES = "1:256,2:640,1:384"
SCRATCH_MIB = 2048
"""The pods' scratch disks: podvm admits a pod only where its whole disk fits."""
CALL_TIMEOUT = 600.0
"""Seconds one CRI call may take: twenty TCG guests booting on two CPUs take minutes."""


@dataclass
class ScaleRun:
    runtime: str
    pods: list[PodRun]
    start_s: float = 0.0
    cpu_s: dict[str, float] = field(default_factory=dict)
    teardown_s: float = 0.0
    """The removal of all at once: the first StopPodSandbox's call to the last
    RemovePodSandbox's return."""
    teardown_errors: list[str] = field(default_factory=list)
    left: list[str] = field(default_factory=list)
    phases: dict[str, list[float]] = field(default_factory=dict)
    deletes: Deletes = field(default_factory=Deletes)
    removal: dict[str, float] = field(default_factory=dict)
    """podvm: the medians of a pod's removal phases (bench/scalelog.py's REMOVAL)."""
    past_deadline: Counter = field(default_factory=Counter)
    swept: list[int] = field(default_factory=list)
    """Per `delete` that swept: how many sandboxes' stale state it removed."""
    restored: int = 0
    templates_made: list[str] = field(default_factory=list)
    log_from: int = 0
    """Where in containerd's log the run began."""

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


def warm_fork_server(ctd: Containerd, work: pathlib.Path, tag: str,
                     shape: tuple[int, int]) -> None:
    """One pod started and removed first, as on a node where pods have been starting: the
    shim's fork server up and its worker parent loaded (shim/contract/forkserver.py), which
    a node's first pod spawns and which stays while pods it forked run, then exits after
    10 idle minutes."""
    pod = PodRun(f"{tag}-warm", shape, "podvm")
    with CriClient(ctd.cri_endpoint, timeout=CALL_TIMEOUT) as client:
        start_pod(client, ctd, work, pod)
        error = remove_pod(client, pod)
    if error or not forkservers.wait_loaded():
        raise RuntimeError(f"the fork server was not warmed: {error or 'none came up'}")


def run_scale(ctd: Containerd, work: pathlib.Path, count: int,
              shapes: list[tuple[int, int]], warm: bool = True,
              runtime: str = "podvm", warm_server: bool = False) -> ScaleRun:
    """Start `count` pods of `runtime` at once on the started CRI containerd `ctd`, measure
    them, remove them all at once, and see what is left. `warm` (podvm): the default
    shape's template is made first, as the node installer has it made (`podvmctl templates
    warm`); else the first pods of every shape boot. `warm_server` (podvm): one pod started
    and removed first (warm_fork_server); else the first `start`s may spawn the fork
    server."""
    tag = f"scale-{runtime}-{uuid.uuid4().hex[:6]}"
    if warm and runtime == "podvm":
        warm_templates(pathlib.Path(ctd.podvm_config))
    if warm_server and runtime == "podvm":
        warm_fork_server(ctd, work, tag, shapes[0])
    run = ScaleRun(runtime, [PodRun(f"{tag}-{i}", shapes[i % len(shapes)], runtime)
                             for i in range(count)])
    before = {pid: cpu_seconds(pid) for pid in pod_processes(ctd, [])}
    run.log_from = len(ctd.log())
    with CriClient(ctd.cri_endpoint, timeout=CALL_TIMEOUT) as client, \
            ThreadPoolExecutor(max_workers=count) as pool:
        started = time.monotonic()
        list(pool.map(lambda p: start_pod(client, ctd, work, p), run.pods))
        run.start_s = time.monotonic() - started
        if runtime == "podvm":
            run.cpu_s = cpu_by_role(pod_processes(ctd, run.pods), before)
        reader = Reader()
        for pod in run.pods:
            check_running(client, pod)
            measure_pod(ctd, reader, pod)
        errors = list(pool.map(lambda p: remove_pod(client, p), run.pods))
        run.teardown_s = removal_wall(run.pods)
    run.teardown_errors = [e for e in errors if e]
    run.left = leftovers(ctd, run.pods)
    log = ctd.log()[run.log_from:]
    run.deletes = read_deletes(run.pods, log)
    if runtime == "podvm":
        lines = log.splitlines()
        run.removal = removal_medians(lines, run.pods)
        run.past_deadline = past_deadline(lines, run.pods)
        spent = [pod_phases(lines, p) for p in run.pods if p.pod_id]
        run.phases = {name: [s[k] for s in spent if s] for k, (name, _) in enumerate(PHASES)}
        run.restored, run.templates_made = template_use(log, run.pods)
        run.swept = [int(n) for n in re.findall(r"swept the state of (\d+) sandboxes", log)]
    return run


def spread(values: list[float]) -> str:
    if not values:
        return "none"
    ordered = sorted(values)
    p90 = ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]
    return (f"p50 {statistics.median(ordered):.2f} s, p90 {p90:.2f} s, "
            f"max {ordered[-1]:.2f} s")


def report(run: ScaleRun) -> str:
    """Every pod's line and the run's figures; a runc run's are those a runc pod has."""
    lines = [f"{run.runtime}:"]
    for pod in run.pods:
        mem = f"{pod.memory_bytes / 2**20:.0f} MiB" if pod.memory_bytes else "?"
        lines.append(f"{pod.name} {pod.shape[0]}:{pod.shape[1]}  ready {pod.ready_s:6.2f} s  "
                     f"running {pod.running_s:6.2f} s  charged {mem:>8}  "
                     f"removed in {pod.removed_s:5.2f} s  {pod.error or 'ok'}")
    ok = [p for p in run.pods if not p.error]
    lines.append(f"{len(run.pods)} {run.runtime} pods at once: all started in "
                 f"{run.start_s:.2f} s, {len(run.failed)} failed")
    lines.append(f"runp to ready        {spread([p.ready_s for p in ok])}")
    lines.append(f"to container running {spread([p.running_s for p in ok])}")
    if run.runtime == "podvm":
        lines += podvm_figures(run, ok)
    lines.append(f"removal (all at once) {run.teardown_s:.2f} s; stopp+rmp per pod "
                 f"{spread([p.removed_s for p in run.pods if p.pod_id])}")
    if run.runtime == "podvm":
        lines.append("  removal (median)   " + (", ".join(
            f"{name} {sec:.2f} s" for name, sec in run.removal.items()) or "?"))
        lines.append("  shim calls answered at their deadline: " + (", ".join(
            f"{method} {n}" for method, n in sorted(run.past_deadline.items())) or "none"))
        written = run.deletes.written
        lines.append(f"shim delete          {run.deletes.runs} runs, {len(written)} wrote "
                     f"their line: its cleanup {spread([d[0] for d in written])}")
        lines.append(f"  since its exec     {spread([d[1] for d in written])}")
        lines.append(f"  as containerd sees {spread(seen_by_containerd(run))}"
                     " (containerd kills it at 5 s)")
        lines.append(f"stale sandbox states swept by later deletes: {sum(run.swept)}")
    else:
        lines.append(f"shim delete          {run.deletes.runs} runs (runc's writes no line)")
    lines += [f"removal error: {e}" for e in run.teardown_errors]
    lines.append(f"shim deletes killed or failed: {len(run.deletes.failed)}")
    lines += [f"  {line}" for line in run.deletes.failed]
    lines.append("left: " + ("nothing" if not run.left else "; ".join(run.left)))
    return "\n".join(lines)


def seen_by_containerd(run: ScaleRun) -> list[float]:
    return [d[2] for d in run.deletes.written if d[2] == d[2]]  # nan: its start line not found


def podvm_figures(run: ScaleRun, ok: list[PodRun]) -> list[str]:
    """What only a podvm run has: templates, memory by shape, CPU by role, phases."""
    lines = []
    lines.append(f"templates            {run.restored} pods restored one; made during the "
                 f"run: {', '.join(run.templates_made) or 'none'}")
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
    return lines


def side_by_side(runs: list[ScaleRun]) -> str:
    """The runtimes' starts, removals, deletes and leftovers in columns."""
    count = len(runs[0].pods)
    lines = [f"{' and '.join(r.runtime for r in runs)} side by side: {count} pods each, "
             "started at once, one thread a pod, on the same containerd",
             f"  {'':<34}" + "".join(f"{r.runtime:<44}" for r in runs)]

    def row(label: str, get) -> None:
        lines.append(f"  {label:<34}" + "".join(f"{get(r):<44}" for r in runs))

    row("runp to ready", lambda r: spread([p.ready_s for p in r.pods if not p.error]))
    row("to container running", lambda r: spread([p.running_s for p in r.pods
                                                   if not p.error]))
    row(f"removal of all {count} at once", lambda r: f"{r.teardown_s:.2f} s")
    row("stopp+rmp per pod", lambda r: p50_max([p.removed_s for p in r.pods if p.pod_id]))
    row("shim delete as containerd saw it", lambda r: f"{r.deletes.runs} runs" + (
        f", {p50_max(seen_by_containerd(r))}" if r.deletes.written else " (no line)"))
    row("shim deletes killed or failed", lambda r: str(len(r.deletes.failed)))
    row("pods failed", lambda r: str(len(r.failed)))
    row("left", lambda r: "nothing" if not r.left else f"{len(r.left)} things")
    if len(runs) == 2:
        lines.append(f"  removal of all at once: {runs[0].runtime} - {runs[1].runtime} = "
                     f"{runs[0].teardown_s - runs[1].teardown_s:+.2f} s")
    return "\n".join(lines)


def p50_max(values: list[float]) -> str:
    if not values:
        return "none"
    return f"p50 {statistics.median(values):.2f} s, max {max(values):.2f} s"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pods", type=int, default=20)
    parser.add_argument("--shapes", default=SHAPES, type=sizes,
                        help=f"vCPUs:MiB of the pods in turn (default {SHAPES})")
    parser.add_argument("--accel", default="tcg")
    parser.add_argument("--boot-timeout", type=int, default=600,
                        help="seconds a guest may take to come up (boot_timeout; default 600: "
                        "twenty TCG guests booting at once on two CPUs take minutes)")
    parser.add_argument("--scratch-disk-mib", type=int, default=SCRATCH_MIB,
                        help=f"each pod's scratch disk (default {SCRATCH_MIB}: twenty of the "
                             "10 GiB default would need 200 GiB free, or be refused)")
    parser.add_argument("--cold", action="store_true",
                        help="no template made first (podvmctl templates warm, as the node "
                             "installer runs it) nor a pod started and removed before: the "
                             "first pods of every shape boot, the first starts spawn the "
                             "shim's fork server")
    parser.add_argument("--keep-log", type=pathlib.Path, metavar="FILE",
                        help="copy containerd's log (the shims' lines included) to FILE")
    parser.add_argument("--runtimes", default=",".join(RUNTIMES), type=runtimes,
                        help="podvm, runc or both, run in this order on the same containerd "
                             "(default podvm,runc)")
    args = parser.parse_args()
    if args.pods < 1:
        parser.error("--pods: at least 1")
    with tempfile.TemporaryDirectory(prefix="podvm-scale-") as tmp:
        work = pathlib.Path(tmp)
        config = write_test_config(work / "podvm.toml", accel=args.accel,
                                   template_path=str(work / "templates"),
                                   boot_timeout=args.boot_timeout,
                                   scratch_disk_mib=args.scratch_disk_mib,
                                   enable_annotations=("default_vcpus", "default_memory"))
        with Containerd(work / "containerd", namespace="podvm-scale", cri=True,
                        podvm_config=config) as ctd:
            ctd.import_cri_images(work)
            runs = [run_scale(ctd, work, args.pods, args.shapes, warm=not args.cold,
                              runtime=runtime, warm_server=not args.cold)
                    for runtime in args.runtimes]
            log = ctd.log()
            for run in runs:  # a delete of one run's may end in the next run's time
                run.deletes = read_deletes(run.pods, log[run.log_from:])
            stray = unattributed_failures(log[runs[0].log_from:],
                                          [p for r in runs for p in r.pods])
            if args.keep_log:
                shutil.copyfile(ctd.log_path, args.keep_log)
        forced = ctd.forced
    print("\n\n".join(report(run) for run in runs))
    print()
    print(side_by_side(runs))
    if stray:
        print("shim deletes killed or failed, of no pod of the runs':\n  " + "\n  ".join(stray))
    if forced:
        print("containerd's stop had to force: " + "; ".join(forced))
    bad = any(r.failed or r.left or r.teardown_errors or r.deletes.failed for r in runs)
    return 1 if bad or stray or forced else 0


if __name__ == "__main__":
    sys.exit(main())
