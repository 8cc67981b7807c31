"""Pod figures under the CRI: runp to ready, the guest image's size, and the RSS of an
idle pod's shim daemon and QEMU. Runs on a private containerd like the tests.

Target (issue 15, truth of resources part 2): runp to ready in 3 s or less (median) under
TCG on these machines (was 5 s in the VM-pods issue).

With templates (the default) the default shape's template is made before the first pod
(`podvmctl templates warm`, as the node installer runs it) and every pod restores it.
--cold: no warm-up, as on a node whose installer did not warm: the first pod boots and its
shim makes the template in the background, and the pods started before it is saved boot
too; the figures say which pods were restored, from what the shims logged.
--no-template: every pod boots, as before templates.

--sizes 1:256,2:640: the pods take these sizes in turn (vCPUs:MiB, as Kata's sizing
annotations set them); with templates, every size restores the one template of the
default size (1:256) and a larger pod is grown to its own by hot-plug: the figures by size
show what the hot-plug costs.

Beside runc (issue 30): each podvm pod is followed by a runc pod of the same image on the
same containerd (--runtimes sets which and in what order), every pod with one container
(a sleep in the busybox test image) and a pod cgroup of its own; podvm's figures are then
printed as ratios to runc's: runp to ready, runp + create + start to the container
running, and the host memory an idle pod holds (its processes' RSS, its pod cgroup's
charge). The CRI calls are made and timed from this process (bench/podcost.py).

usage: python bench/pod_bench.py [--pods N] [--accel tcg|kvm] [--no-template | --cold]
                                 [--sizes V:M,...] [--shared-fs virtio-fs|virtio-9p]
                                 [--scratch-disk-mib MIB] [--runtimes podvm,runc]
                                 [--keep-log FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench.podcost import (RUNTIMES, CriPods, PodCost, comparison,  # noqa: E402
                           crictl_call, describe, guest_waits, legend, measure_idle,
                           medians,
                           restored_from_template, runtimes)
from shim.resources.annotations import KATA  # noqa: E402
from shim.config import HypervisorConfig  # noqa: E402
from testbed.containerd import Containerd  # noqa: E402
from testbed.pods import pod_config  # noqa: E402
from testbed.vmconfig import GUEST, warm_templates, write_test_config  # noqa: E402

MIB = 1 << 20


PHASES = (  # (name, containerd/shim log message that ends it); each starts where the last ends
    ("containerd+shim start", "serving containerd.task"),
    ("plan+cgroup", "starting QEMU"),
    ("QEMU start to agent port", "guest agent port open"),
    ("threads, ping", "VM ready in"),
    ("rest of runp", "returns sandbox id"),
)


def phases(log: str, pod_id: str) -> list[float]:
    """Seconds spent in each of PHASES for one pod, from the timestamps in containerd's log
    (the shim's lines included); [] when a line is missing."""
    def at(line: str) -> float:
        stamp = line.split('"', 2)[1]  # time="2026-11-22T17:30:52.344193028Z"
        hms = stamp.split("T", 1)[1].rstrip("Z")
        h, m, sec = hms.split(":")
        return int(h) * 3600 + int(m) * 60 + float(sec)

    lines = [ln for ln in log.splitlines() if pod_id in ln or "RunPodSandbox for" in ln]
    starts = [at(ln) for ln in lines if "RunPodSandbox for" in ln and "returns" not in ln]
    marks = []
    for _, needle in PHASES:
        found = [at(ln) for ln in lines if needle in ln and pod_id in ln]
        if not found or not starts:
            return []
        marks.append(found[0])
    start = max(t for t in starts if t <= marks[0])
    return [b - a for a, b in zip([start] + marks, marks)]


def sizes(text: str) -> list[tuple[int, int]]:
    try:
        out = [tuple(int(n) for n in item.split(":")) for item in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: want vCPUs:MiB[,vCPUs:MiB...]") from None
    if not out or any(len(s) != 2 or min(s) <= 0 for s in out):
        raise argparse.ArgumentTypeError(f"{text!r}: want vCPUs:MiB[,vCPUs:MiB...]")
    return out  # type: ignore[return-value]


def annotations(size: tuple[int, int]) -> dict[str, str]:
    return {KATA + "default_vcpus": str(size[0]), KATA + "default_memory": str(size[1])}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pods", type=int, default=5,
                        help="pods of each runtime, alternated (default 5)")
    parser.add_argument("--accel", default="tcg")
    parser.add_argument("--no-template", action="store_true",
                        help="every pod boots its guest (enable_template = false)")
    parser.add_argument("--cold", action="store_true",
                        help="no template made before the first pod (podvmctl templates warm)")
    parser.add_argument("--keep-log", type=pathlib.Path, metavar="FILE",
                        help="copy containerd's log (the shims' lines included) to FILE")
    parser.add_argument("--shared-fs", default="virtio-fs", choices=("virtio-fs", "virtio-9p"),
                        help="how the pod's files reach the guest (shared_fs)")
    parser.add_argument("--scratch-disk-mib", type=int,
                        default=HypervisorConfig.scratch_disk_mib,
                        help="the pods' scratch disk (scratch_disk_mib; 0: none)")
    parser.add_argument("--virtio-fs-daemon", metavar="PATH",
                        help="the pods' virtiofsd (default: the node's, as the shim picks "
                             "it; build/virtiofsd/virtiofsd: the Rust one `make virtiofsd` "
                             "fetches)")
    parser.add_argument("--sizes", default="1:256", type=sizes,
                        help="vCPUs:MiB of the pods in turn (default 1:256, the default size)")
    parser.add_argument("--runtimes", default=",".join(RUNTIMES), type=runtimes,
                        help="podvm, runc or both, each round's pods in this order "
                             "(default podvm,runc)")
    args = parser.parse_args()
    if args.pods < 1:
        parser.error("--pods must be at least 1")
    return args


def one_pod(ctd: Containerd, pods: CriPods, work: pathlib.Path, runtime: str, i: int,
            size: tuple[int, int]) -> tuple[PodCost, list[float]]:
    """Pod `i` of `runtime` started, measured idle and removed; its line printed."""
    name = f"b{i}" if runtime == "podvm" else f"r{i}"
    config = pod_config(ctd, work, name, **(
        {"annotations": annotations(size)} if runtime == "podvm" else {}))
    pod_cgroup = config["linux"]["cgroup_parent"] = f"{ctd.cgroup_parent}/{name}"
    cost = pods.start(runtime, config, name)
    try:
        time.sleep(2)  # idle
        measure_idle(ctd, cost, pod_cgroup)
    finally:
        pods.remove(cost.pod_id)
    if runtime != "podvm":
        print(f"{runtime} pod {i}: runp to ready {cost.ready_s:.2f} s, "
              + describe(cost), flush=True)
        return cost, []
    log = ctd.log()
    spent = phases(log, cost.pod_id)
    cost.restored = restored_from_template(log, cost.pod_id)
    ready_waits = guest_waits(log, cost.pod_id)
    container_waits = guest_waits(log, cost.container_id)
    if ready_waits is None or container_waits is None:
        raise RuntimeError(f"pod {cost.pod_id}: the shim logged no guest share of its "
                           f"containers' Create and Start")
    cost.guest_ready_s, cost.guest_container_s = ready_waits, container_waits
    print(f"pod {i} ({size[0]} vCPUs, {size[1]} MiB): runp to ready "
          f"{cost.ready_s:.2f} s ("
          + ", ".join(f"{phase} {t:.2f}" for (phase, _), t in zip(PHASES, spent))
          + ")", flush=True)
    print(f"  {'restored' if cost.restored else 'booted'}; the host's share of ready "
          f"{cost.host_ready_s:.2f} s (the guest {cost.guest_ready_s:.2f}), of the "
          f"container's create + start {cost.host_container_s:.2f} s of "
          f"{cost.container_s:.2f}; " + describe(cost), flush=True)
    return cost, spent


def run(args: argparse.Namespace) -> tuple[dict[str, list[PodCost]], list[list[float]],
                                           list[float]]:
    """Every pod, the runtimes alternated pod by pod: costs by runtime, podvm's phases,
    and what a crictl process added to a call, once a round."""
    costs: dict[str, list[PodCost]] = {r: [] for r in args.runtimes}
    spent: list[list[float]] = []
    crictl_s: list[float] = []
    with tempfile.TemporaryDirectory(prefix="podvm-pod-bench-") as tmp:
        work = pathlib.Path(tmp)
        config = write_test_config(work / "podvm.toml", accel=args.accel,
                                   enable_template=not args.no_template,
                                   shared_fs=args.shared_fs,
                                   scratch_disk_mib=args.scratch_disk_mib,
                                   **({"virtio_fs_daemon":
                                       os.path.abspath(args.virtio_fs_daemon)}
                                      if args.virtio_fs_daemon else {}),
                                   template_path=str(work / "templates"),
                                   enable_annotations=("default_vcpus", "default_memory"))
        if not args.cold:
            warm_templates(config)
        with Containerd(work / "containerd", namespace="podvm-bench", cri=True,
                        podvm_config=config) as ctd:
            ctd.import_cri_images(work)
            pods = CriPods(ctd)
            try:
                for i in range(args.pods):
                    for runtime in args.runtimes:
                        cost, phase = one_pod(ctd, pods, work, runtime, i,
                                              args.sizes[i % len(args.sizes)])
                        costs[runtime].append(cost)
                        spent += [phase] if runtime == "podvm" else []
                    crictl_s.append(crictl_call(ctd))
            finally:
                pods.close()
            if args.keep_log:
                shutil.copyfile(ctd.log_path, args.keep_log)
        if ctd.forced:
            print(f"warning: the harness had to force its cleanup: {ctd.forced}",
                  file=sys.stderr)
    return costs, spent, crictl_s


def report_podvm(args: argparse.Namespace, podvm: list[PodCost],
                 spent: list[list[float]]) -> None:
    """The figures this bench printed before runc was beside it."""
    ready = [c.ready_s for c in podvm]
    print(f"runp to ready        median {statistics.median(ready):.2f} s, "
          f"max {max(ready):.2f} s   target <= 3 s median (TCG)")
    if not args.no_template:
        restored = [c.ready_s for c in podvm if c.restored]
        booted = [c.ready_s for c in podvm if not c.restored]
        print(f"  with templates{' (cold)' if args.cold else ''}: {len(restored)} restored"
              + (f", median {statistics.median(restored):.2f} s" if restored else "")
              + f"; {len(booted)} booted"
              + (f", median {statistics.median(booted):.2f} s" if booted else ""))
    if len(args.sizes) > 1:
        for k, size in enumerate(args.sizes):
            of_size = [c.ready_s for i, c in enumerate(podvm)
                       if i % len(args.sizes) == k and c.restored]
            if of_size:
                print(f"  {size[0]} vCPUs, {size[1]:4} MiB  restored pods' median "
                      f"{statistics.median(of_size):.2f} s ({len(of_size)} pods)")
    spent = [p for p in spent if p]
    if spent:
        print("  median by phase    " + ", ".join(
            f"{name} {statistics.median(p[k] for p in spent):.2f}"
            for k, (name, _) in enumerate(PHASES)))
    med = statistics.median
    print(f"the host's share     of ready median {med(c.host_ready_s for c in podvm):.2f} s "
          f"(the guest {med(c.guest_ready_s for c in podvm):.2f}); of a container's create "
          f"+ start median {med(c.host_container_s for c in podvm):.2f} s of "
          f"{med(c.container_s for c in podvm):.2f}   target <= 0.35 s each (issue 47)")
    print(f"guest image          vmlinux {(GUEST / 'vmlinux').stat().st_size / MIB:.1f} MiB, "
          f"initrd.img {(GUEST / 'initrd.img').stat().st_size / MIB:.1f} MiB")
    print(f"idle pod shim RSS    median "
          f"{statistics.median(c.rss_mib.get('shim', 0.0) for c in podvm):.1f} MB")
    print(f"idle pod QEMU RSS    median "
          f"{statistics.median(c.rss_mib.get('QEMU', 0.0) for c in podvm):.1f} MB "
          f"(guest memory 256 MiB, touched pages only)")


def main() -> int:
    args = parse_args()
    costs, spent, crictl_s = run(args)
    manifest = json.loads((GUEST / "manifest.json").read_text())
    print(f"{args.pods} pods, accel={args.accel}, guest kernel {manifest['kernel_release']}"
          + ("; as many runc pods, alternated" if len(args.runtimes) > 1 else
             f"; runtime {args.runtimes[0]}"))
    if "podvm" in costs:
        report_podvm(args, costs["podvm"], spent)
    for runtime, of_runtime in costs.items():
        print(medians(runtime, of_runtime))
    if len(costs) == 2:
        print("\n".join(comparison(costs["podvm"], costs["runc"])))
    print("\n".join(legend(args.runtimes, crictl_s)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
