"""Pod figures under the CRI: runp to ready, the guest image's size, and the RSS of an
idle pod's shim daemon and QEMU. Runs on a private containerd like the tests.

Target (issue 15, truth of resources part 2): runp to ready in 3 s or less (median) under
TCG on these machines (was 5 s in the VM-pods issue).

With templates (the default) the first pod boots its guest and saves it as the shape's
template, the others restore it: the figures say which is which. --no-template: every
pod boots, as before templates.

--sizes 1:256,2:640: the pods take these sizes in turn (vCPUs:MiB, as Kata's sizing
annotations set them); with templates, every size restores the one template of the
default size (1:256) and a larger pod is grown to its own by hot-plug: the figures by size
show what the hot-plug costs.

usage: python bench/pod_bench.py [--pods N] [--accel tcg|kvm] [--no-template]
                                 [--sizes V:M,...] [--shared-fs virtio-fs|virtio-9p]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from tests.e2e.containerd import Containerd, shims_of  # noqa: E402
from tests.e2e.cri import Crictl, write_config  # noqa: E402
from tests.e2e.test_crictl import pod_config  # noqa: E402
from tests.e2e.test_podvm_pods import pod_qemus  # noqa: E402
from shim.resources.annotations import KATA  # noqa: E402
from tests.vmconfig import GUEST, write_test_config  # noqa: E402

MIB = 1 << 20


def rss_mb(pid: int) -> float:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pods", type=int, default=5)
    parser.add_argument("--accel", default="tcg")
    parser.add_argument("--no-template", action="store_true",
                        help="every pod boots its guest (enable_template = false)")
    parser.add_argument("--keep-log", type=pathlib.Path, metavar="FILE",
                        help="copy containerd's log (the shims' lines included) to FILE")
    parser.add_argument("--shared-fs", default="virtio-fs", choices=("virtio-fs", "virtio-9p"),
                        help="how the pod's files reach the guest (shared_fs)")
    parser.add_argument("--sizes", default="1:256", type=sizes,
                        help="vCPUs:MiB of the pods in turn (default 1:256, the default size)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="podvm-pod-bench-") as tmp:
        work = pathlib.Path(tmp)
        config = write_test_config(work / "podvm.toml", accel=args.accel,
                                   enable_template=not args.no_template,
                                   shared_fs=args.shared_fs,
                                   template_path=str(work / "templates"),
                                   enable_annotations=("default_vcpus", "default_memory"))
        with Containerd(work / "containerd", namespace="podvm-bench", cri=True,
                        podvm_config=config) as ctd:
            ctd.import_cri_images(work)
            crictl = Crictl(ctd.cri_endpoint, timeout="120s")
            ready, shim_rss, qemu_rss, spent = [], [], [], []
            for i in range(args.pods):
                size = args.sizes[i % len(args.sizes)]
                pod_file = write_config(work, f"pod{i}.json", pod_config(
                    ctd, work, f"b{i}", annotations=annotations(size)))
                started = time.monotonic()
                pod_id = crictl.runp(pod_file, runtime="podvm")
                ready.append(time.monotonic() - started)
                time.sleep(2)  # idle
                shim_rss += [rss_mb(pid) for pid, cmd in shims_of(ctd.address)
                             if pod_id in cmd]
                qemu_rss += [rss_mb(pid) for pid in pod_qemus(pod_id)]
                crictl.run("stopp", pod_id)
                crictl.run("rmp", pod_id)
                spent.append(phases(ctd.log(), pod_id))
                print(f"pod {i} ({size[0]} vCPUs, {size[1]} MiB): runp to ready "
                      f"{ready[-1]:.2f} s ("
                      + ", ".join(f"{name} {t:.2f}" for (name, _), t in zip(PHASES, spent[-1]))
                      + ")", flush=True)
            if args.keep_log:
                shutil.copyfile(ctd.log_path, args.keep_log)
    manifest = json.loads((GUEST / "manifest.json").read_text())
    print(f"{args.pods} pods, accel={args.accel}, guest kernel {manifest['kernel_release']}")
    print(f"runp to ready        median {statistics.median(ready):.2f} s, "
          f"max {max(ready):.2f} s   target <= 3 s median (TCG)")
    if not args.no_template and len(ready) > 1:
        print(f"  with templates     first pod (boots and saves the template) "
              f"{ready[0]:.2f} s, the others (restore it) median "
              f"{statistics.median(ready[1:]):.2f} s")
    if len(args.sizes) > 1:
        for k, size in enumerate(args.sizes):
            of_size = [t for i, t in enumerate(ready) if i % len(args.sizes) == k and i > 0]
            if of_size:
                print(f"  {size[0]} vCPUs, {size[1]:4} MiB  restored pods' median "
                      f"{statistics.median(of_size):.2f} s ({len(of_size)} pods)")
    spent = [p for p in spent if p]
    if spent:
        print("  median by phase    " + ", ".join(
            f"{name} {statistics.median(p[k] for p in spent):.2f}"
            for k, (name, _) in enumerate(PHASES)))
    print(f"guest image          vmlinux {(GUEST / 'vmlinux').stat().st_size / MIB:.1f} MiB, "
          f"initrd.img {(GUEST / 'initrd.img').stat().st_size / MIB:.1f} MiB")
    print(f"idle pod shim RSS    median {statistics.median(shim_rss):.1f} MB")
    print(f"idle pod QEMU RSS    median {statistics.median(qemu_rss):.1f} MB "
          f"(guest memory 256 MiB, touched pages only)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
