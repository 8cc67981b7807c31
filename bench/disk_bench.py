"""The pod's disk, runc beside podvm through containerd's CRI (issue 44), in one run on one
private containerd, one pod at a time, the runtimes alternated figure by figure:

- writing: dd from /dev/zero, bs=1M, conv=fsync (busybox's dd) of --write-mib MiB into
  the container's root, then into an emptyDir (a directory shaped as kubelet makes one):
  seconds in the container and MiB/s; the host's disk the write took (runc: du of the
  overlay upper directory and of the emptyDir's host directory; podvm: the blocks of the
  pod's scratch file, through its QEMU's descriptor); and how soon the write was seen
  where kubelet looks (runc: ContainerStats' writable layer, the emptyDir's directory;
  podvm: the disk's link in the pod's log directory, shim/host/podlogdisk.py), within one
  stats period (10 s).
- a limit: a pod whose container has ephemeral-storage --limit-mib (the annotation
  podvm-webhook writes, storage.podvm.io/limits) writes --over-mib MiB into its root:
  what was written and what dd said. runc is given the same pod: containerd bounds
  nothing, kubelet would evict the pod once it sees the usage.
- the node's free space while a podvm pod with no limit (its disk the default size,
  --disk-mib) writes until its disk is full: statvfs of the scratch file system every
  0.2 s, its minimum against the reserve (scratch_reserve_mib). Not played for runc:
  nothing but kubelet's eviction bounds a runc pod, which would fill the node.

podvm's scratch disks (`scratch_path`) and the pods' log directories are on an ext4 of
its own on a loop device (testbed/loopfs.py), big enough for the blank file system, one
default disk and the reserve: the free space it shows is the pods' alone. Before the
filling pod, a file takes what is free beyond that disk, the reserve and 8 MiB, so that
its disk is the largest the reserve admits (a pod asking 16 MiB more is refused first, to
show it). --disk-mib (default 2304: two 1 GiB files and ext4's share) lowers the default
disk from the node's 10 GiB to keep the fill short.

usage: python bench/disk_bench.py [--write-mib MIB] [--limit-mib MIB] [--over-mib MIB]
                                  [--disk-mib MIB] [--reserve-mib MIB] [--accel tcg|kvm]
                                  [--runtimes podvm,runc]
"""
from __future__ import annotations

import argparse
import os
import pathlib
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench.diskpods import (EMPTY_DIR, STATS_PERIOD_S, DiskPods, Pod, Write,  # noqa: E402
                            du, first_seen)
from bench.net_bench import loadavg, machine, terminated  # noqa: E402
from bench.podcost import RUNTIMES, runtimes  # noqa: E402
from shim.config import HypervisorConfig  # noqa: E402
from shim.resources.storage import (ANNOTATION, BLANK_MIB, EXT4_FIXED_MIB,  # noqa: E402
                                    EXT4_METADATA_PERCENT, StorageRequest, encode)
from testbed.containerd import Containerd  # noqa: E402
from testbed.criclient import CriError  # noqa: E402
from testbed.loopfs import LoopFs  # noqa: E402
from testbed.vmconfig import warm_templates, write_test_config  # noqa: E402

MIB = 1 << 20
SLACK_MIB = 64
"""The loop file system's room beyond the blank, one default disk and the reserve."""
FILL_ROOM_MIB = 8
"""What the filling pod's disk leaves of the free space beyond the reserve: the rest is
taken by a file first, so that its disk is (within this) the largest the reserve admits."""
PLACES = (("root", "/fill"), ("emptyDir", f"{EMPTY_DIR}/fill"))


def mib(n: int) -> str:
    return f"{n / MIB:.1f} MiB"


def seen_text(seen_s: float | None, value: int) -> str:
    return (f"seen after {seen_s:.1f} s ({mib(value)})" if seen_s is not None else
            f"not seen within {STATS_PERIOD_S:.0f} s (reads {mib(value)})")


def readers(pods: DiskPods, pod: Pod,
            place: str) -> tuple[Callable[[], int], Callable[[], int]]:
    """(the host's disk the place takes, what kubelet reads of it), each a function."""
    if pod.runtime == "podvm":
        return (lambda: pods.scratch_bytes(pod)), (lambda: du(pod.log_directory))
    if place == "root":
        upper = pods.upper_dir(pod)
        return (lambda: du(upper)), (lambda: pods.writable_layer(pod))
    assert pod.empty_dir is not None
    return (lambda: du(pod.empty_dir)), (lambda: du(pod.empty_dir))


def checked(write: Write, size_mib: int, what: str) -> Write:
    if write.exit_code != 0 or write.size != size_mib * MIB:
        raise RuntimeError(f"{what}: dd exited {write.exit_code} with {mib(write.size)} "
                           f"written: {write.error}")
    return write


def write_figures(pods: DiskPods, runtime: str, size_mib: int) -> list[str]:
    """--write-mib into the root, then into the emptyDir, of one pod: a row each."""
    pod = pods.start(runtime, f"write-{runtime}", empty_dir=True)
    rows = []
    try:
        for place, path in PLACES:
            host, kubelet = readers(pods, pod, place)
            host_before, seen_before = host(), kubelet()
            w = checked(pods.write(pod, path, size_mib), size_mib, f"{runtime} {place}")
            took = host() - host_before
            seen_s, seen = first_seen(kubelet, seen_before + w.size * 95 // 100)
            layer = pods.writable_layer(pod)
            rows.append(f"| {runtime} | {place} | {w.seconds:.2f} | "
                        f"{size_mib / w.seconds:.1f} | {w.wall_s:.2f} | {mib(took)} | "
                        f"{seen_text(seen_s, seen)} | {mib(layer)} |")
            print(rows[-1], flush=True)
    finally:
        pods.remove(pod)
    return rows


def limit_figure(pods: DiskPods, runtime: str, limit_mib: int, over_mib: int) -> str:
    """A container limited to `limit_mib` (the webhook's annotation) writes `over_mib`."""
    annotation = encode(StorageRequest(containers={"c": limit_mib * MIB}, empty_dirs={},
                                       unbounded=()))
    pod = pods.start(runtime, f"limit-{runtime}", {ANNOTATION: annotation})
    try:
        w = pods.write(pod, "/fill", over_mib)
        if runtime == "podvm":
            where, (_, seen) = "pod log directory (du)", first_seen(
                lambda: du(pod.log_directory), w.size)
        else:
            where, (_, seen) = "ContainerStats writable layer", first_seen(
                lambda: pods.writable_layer(pod), w.size)
    finally:
        pods.remove(pod)
    over = "over" if seen > limit_mib * MIB else "within"
    row = (f"| {runtime} | {mib(w.size)} of {over_mib} MiB | exit {w.exit_code}: "
           f"{w.error or 'no error'} | {w.seconds:.2f} | {where}: {mib(seen)}, {over} "
           f"the {limit_mib} MiB limit |")
    print(row, flush=True)
    return row


class FreeSampler(threading.Thread):
    """statvfs of the loop file system every `step_s` until stopped; its minimum."""

    def __init__(self, fs: LoopFs, step_s: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.fs, self.step_s = fs, step_s
        self.lowest, self.samples = fs.free_bytes(), 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            self.lowest = min(self.lowest, self.fs.free_bytes())
            self.samples += 1
            self.done.wait(self.step_s)

    def stop(self) -> int:
        self.done.set()
        self.join()
        return self.lowest


def fill_figure(pods: DiskPods, fs: LoopFs, disk_mib: int, reserve_mib: int) -> list[str]:
    """A podvm pod with no limit writes until its disk is full, the free space sampled;
    the free space first brought down to its disk + the reserve + FILL_ROOM_MIB."""
    filler = fs.mountpoint / "filler"
    taken = fs.free_bytes() - (disk_mib + reserve_mib + FILL_ROOM_MIB) * MIB
    with open(filler, "xb") as f:
        if taken > 0:
            os.posix_fallocate(f.fileno(), 0, taken)
    try:
        refused = refusal(pods, disk_mib + FILL_ROOM_MIB + 16)
        before = fs.free_bytes()
        sampler = FreeSampler(fs)
        sampler.start()
        try:
            w, held, code, said = fill_pod(pods)
        finally:
            lowest = sampler.stop()
        after = fs.free_bytes()
    finally:
        filler.unlink()
    lines = [f"scratch file system ({fs.size_mib} MiB ext4 on a loop device, "
             f"{mib(max(taken, 0))} of it taken by a file first): "
             f"{mib(before)} free before the pod, lowest {mib(lowest)} in "
             f"{sampler.samples} samples (every 0.2 s), {mib(after)} once it was removed; "
             f"scratch_reserve_mib {reserve_mib} MiB: lowest - reserve = "
             f"{mib(lowest - reserve_mib * MIB)}",
             f"the pod (no limit, disk {disk_mib} MiB): {mib(w.size)} written in "
             f"{w.seconds:.1f} s ({w.size / MIB / w.seconds:.1f} MiB/s), dd exit "
             f"{w.exit_code}: {w.error or 'no error'}; its disk then held {mib(held)} on "
             f"the host; an exec afterwards: exit {code}, {said.strip()!r}",
             f"a pod asking a {disk_mib + FILL_ROOM_MIB + 16} MiB disk just before it: "
             f"{refused}"]
    print("\n".join(lines), flush=True)
    return lines


def refusal(pods: DiskPods, disk_mib: int) -> str:
    """What runp says of a pod whose disk (its annotation) is about `disk_mib`."""
    data = (disk_mib - EXT4_FIXED_MIB) * 100 // (100 + EXT4_METADATA_PERCENT)
    annotation = encode(StorageRequest(containers={"c": data * MIB}, empty_dirs={},
                                       unbounded=()))
    try:
        pod = pods.start("podvm", "too-big", {ANNOTATION: annotation})
    except CriError as e:
        return f"refused: {e}"
    pods.remove(pod)
    return "admitted (the reserve did not hold it back)"


def fill_pod(pods: DiskPods) -> tuple[Write, int, int, str]:
    """(its dd, what its disk held on the host then, an exec's exit code and output after)."""
    pod = pods.start("podvm", "fill")
    try:
        w = pods.write(pod, "/fill", None)
        held = pods.scratch_bytes(pod)
        code, said, _ = pods.shell(pod, "echo still here", timeout_s=60)
    finally:
        pods.remove(pod)
    return w, held, code, said


def run(args: argparse.Namespace) -> dict[str, list[str]]:
    figures: dict[str, list[str]] = {"write": [], "limit": [], "fill": []}
    fs_mib = BLANK_MIB + args.disk_mib + args.reserve_mib + SLACK_MIB
    with tempfile.TemporaryDirectory(prefix="podvm-disk-bench-", dir="/var/tmp") as tmp:
        work = pathlib.Path(tmp)
        with LoopFs(work / "scratch.img", work / "scratchfs", fs_mib) as fs:
            config = write_test_config(
                work / "podvm.toml", accel=args.accel, template_path=str(work / "templates"),
                scratch_path=str(fs.mountpoint / "scratch"), scratch_disk_mib=args.disk_mib,
                scratch_reserve_mib=args.reserve_mib)
            warm_templates(config)
            with Containerd(work / "containerd", namespace="podvm-disk-bench", cri=True,
                            podvm_config=config) as ctd:
                ctd.import_cri_images(work)
                pods = DiskPods(ctd, fs.mountpoint, work / "kubelet")
                try:
                    for runtime in args.runtimes:
                        figures["write"] += write_figures(pods, runtime, args.write_mib)
                    for runtime in args.runtimes:
                        figures["limit"].append(limit_figure(pods, runtime, args.limit_mib,
                                                             args.over_mib))
                    if "podvm" in args.runtimes:
                        figures["fill"] = fill_figure(pods, fs, args.disk_mib,
                                                      args.reserve_mib)
                finally:
                    pods.close()
            if ctd.forced:
                print(f"warning: the harness had to force its cleanup: {ctd.forced}",
                      file=sys.stderr)
    return figures


def report(args: argparse.Namespace, figures: dict[str, list[str]]) -> list[str]:
    return [
        f"writing {args.write_mib} MiB (dd bs=1M conv=fsync, busybox):",
        "| runtime | place | s in the container | MiB/s | exec s | the host's disk it took "
        "| where kubelet looks | CRI writable layer |", "|---|---|---|---|---|---|---|---|",
        *figures["write"],
        "  where kubelet looks: runc root, ContainerStats' writable layer (containerd "
        "refreshes it every stats_collect_period, 10 s); runc emptyDir, du of its host "
        "directory (kubelet's own du runs every volumeStatsAggPeriod, 1 min by default); "
        "podvm, du of the pod's log directory, where its disk is linked",
        f"a container with ephemeral-storage {args.limit_mib}Mi (podvm: {ANNOTATION} as "
        f"podvm-webhook writes it) writing {args.over_mib} MiB into its root:",
        "| runtime | written | dd | s | what kubelet reads |", "|---|---|---|---|---|",
        *figures["limit"],
        "  runc: containerd bounds nothing; kubelet would evict the pod at its next "
        "eviction pass once it reads the usage over the limit",
        *figures["fill"]]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write-mib", type=int, default=1024,
                        help="MiB written into the root and into the emptyDir (default 1024)")
    parser.add_argument("--limit-mib", type=int, default=200,
                        help="the container's ephemeral-storage limit (default 200)")
    parser.add_argument("--over-mib", type=int, default=300,
                        help="MiB the limited container writes (default 300)")
    parser.add_argument("--disk-mib", type=int, default=2304,
                        help="podvm's default scratch disk, scratch_disk_mib (default 2304)")
    parser.add_argument("--reserve-mib", type=int,
                        default=HypervisorConfig.scratch_reserve_mib,
                        help="scratch_reserve_mib (default %(default)s, podvm's own)")
    parser.add_argument("--accel", default="tcg", help="podvm's QEMU accel (default tcg)")
    parser.add_argument("--runtimes", default=",".join(RUNTIMES), type=runtimes,
                        help="podvm, runc or both, in this order (default podvm,runc)")
    args = parser.parse_args()
    if args.write_mib < 1 or args.limit_mib < 1 or args.over_mib <= args.limit_mib:
        parser.error("--write-mib and --limit-mib must be at least 1, --over-mib more "
                     "than --limit-mib")
    if args.disk_mib * 98 // 100 - 16 < 2 * args.write_mib or args.disk_mib < BLANK_MIB:
        parser.error(f"--disk-mib {args.disk_mib} cannot hold two files of --write-mib "
                     f"{args.write_mib} (ext4 takes 2% + 16 MiB)")
    signal.signal(signal.SIGTERM, terminated)  # unwinds like Ctrl-C: everything removed
    load_before, started = loadavg(), time.monotonic()
    figures = run(args)
    print(f"\nmachine: {machine(args.accel)}; load average {load_before} before, "
          f"{loadavg()} after; {time.monotonic() - started:.0f} s in all")
    print("\n".join(report(args, figures)))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # everything is removed by then
        print("disk_bench: interrupted; pods, containerd and the loop file system removed",
              file=sys.stderr)
        sys.exit(130)
