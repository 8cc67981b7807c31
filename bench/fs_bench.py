"""File-operation speed in a pod, podvm against runc (issue 29), on one private
containerd: testbed/fsprobe.c's `speed` (create, stat and unlink N files of 4 KiB;
64 MiB written and fsynced, then read back) in a directory of the container's root fs,
in a read-write hostPath volume and in an emptyDir (a directory shaped as kubelet makes
one), and busybox tar extracting 10,000 small files into the root fs (and removing
them), timed in the container with busybox adjtimex as bench/net_bench.py does (busybox
date has no %N).

And SQLite (testbed/sqliteprobe.c, built static against Debian's libsqlite3.a, as the
busybox image has no libc) in each place: N inserts each its own transaction
(`synchronous=FULL`: a journal written, synced and removed, the database locked and
synced, every time), then N in one transaction.

`--shared-fs virtio-9p` measures podvm's fallback (its old default) instead;
`--scratch-disk-mib 0`, podvm without a scratch disk (the containers' writable layers on
the host, every file operation over the share, as before the scratch disk);
`--host-empty-dir`, podvm with `disable_guest_empty_dir` (emptyDirs shared from the host
as hostPath volumes are, as before they were the guest's).

usage: python bench/fs_bench.py [--files N] [--tar-files M] [--sqlite-rows R] [--accel tcg|kvm]
                                [--runtime-only podvm|runc] [--shared-fs virtio-fs|virtio-9p]
                                [--scratch-disk-mib MIB] [--host-empty-dir] [--json FILE]
"""
from __future__ import annotations

import argparse
import io
import json
import os
import pathlib
import signal
import sys
import tarfile
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from net_bench import loadavg, machine, parse_loop, terminated, timed_loop  # noqa: E402
from shim.config import SHARED_FS, HypervisorConfig, default_virtio_fs_daemon  # noqa: E402
from testbed.containerd import Containerd  # noqa: E402
from testbed.cri import Crictl, write_config  # noqa: E402
from testbed.fsprobe import build_probe  # noqa: E402
from testbed.kubeletdirs import volume_dir  # noqa: E402
from testbed.netpods import pod_network_config  # noqa: E402
from testbed.pods import container_config  # noqa: E402
from testbed.vmconfig import warm_templates, write_test_config  # noqa: E402

RUNTIMES = ("runc", "podvm")
ROOT_DIR = "/bench"  # in the container's root fs
VOLUME = "/vol"
EMPTY_DIR = "/empty"
PLACES = {"rootfs": (ROOT_DIR, "root fs"), "volume": (VOLUME, "hostPath volume"),
          "emptydir": (EMPTY_DIR, "emptyDir")}
TOOLS = "/probe"  # fsprobe and the tar, read-only
SPEED_OPS = ("create", "stat", "unlink", "write64", "read64")
SQLITE_OPS = ("each", "batch")


def make_tar(path: pathlib.Path, files: int) -> None:
    """`files` files of 512 bytes, 100 to a directory: a small source tree's shape."""
    data = b"x" * 511 + b"\n"
    with tarfile.open(path, "w") as tar:
        for i in range(files):
            info = tarfile.TarInfo(f"tree/d{i // 100:03d}/f{i:05d}")
            info.size, info.mtime = len(data), 1700000000
            tar.addfile(info, io.BytesIO(data))


def parse_sqlite(output: str) -> dict[str, float]:
    """sqliteprobe's `sqlite each s` and `sqlite batch s` as op to seconds."""
    found = {w[1]: float(w[2]) for w in (line.split() for line in output.splitlines())
             if len(w) == 3 and w[0] == "sqlite" and w[1] in SQLITE_OPS}
    if sorted(found) != sorted(SQLITE_OPS) or "sqlite ok" not in output:
        raise RuntimeError(f"sqliteprobe printed {output!r}")
    return found


def parse_speed(output: str) -> dict[str, float]:
    """fsprobe speed's lines (`create N s`, `write64 s`) as op to seconds."""
    found = {line.split()[0]: float(line.split()[-1]) for line in output.splitlines()
             if line.split()[:1] and line.split()[0] in SPEED_OPS}
    if sorted(found) != sorted(SPEED_OPS):
        raise RuntimeError(f"fsprobe speed printed {output!r}")
    return found


class Bench:
    def __init__(self, ctd: Containerd, crictl: Crictl, work: pathlib.Path,
                 tools: pathlib.Path, files: int, sqlite_rows: int) -> None:
        self.ctd, self.crictl, self.work, self.tools = ctd, crictl, work, tools
        self.files, self.sqlite_rows = files, sqlite_rows
        self.kubelet = work / "kubelet"
        """kubelet's root, for the emptyDirs: on a disk (work is not a tmpfs)."""

    def shell(self, cid: str, script: str, deadline: int = 900) -> str:
        r = self.crictl.run("exec", "-s", "--timeout", str(deadline), cid, "sh", "-c",
                            script, check=False, timeout=deadline + 60)
        if r.returncode != 0:
            raise RuntimeError(f"exec in {cid[:13]} exited {r.returncode}: "
                               f"{r.stderr.strip()[-600:]}{r.stdout.strip()[-600:]}")
        return r.stdout

    def pod(self, runtime: str, volume: pathlib.Path,
            empty_dir: pathlib.Path) -> tuple[str, str]:
        name = f"fs-{runtime}"
        pod_file = write_config(self.work, f"pod-{name}.json",
                                pod_network_config(self.ctd, self.work, name))
        pod_id = self.crictl.runp(pod_file, runtime=None if runtime == "runc" else runtime)
        config = dict(container_config(name, "exec sleep 3600"),
                      mounts=[{"container_path": TOOLS, "host_path": str(self.tools),
                               "readonly": True},
                              {"container_path": VOLUME, "host_path": str(volume)},
                              {"container_path": EMPTY_DIR, "host_path": str(empty_dir)}])
        try:
            cid = self.crictl.create(pod_id, write_config(self.work, f"{name}-c.json", config),
                                     pod_file)
            self.crictl.start(cid)
        except BaseException:
            self.remove(pod_id)
            raise
        return pod_id, cid

    def remove(self, pod_id: str) -> None:
        self.crictl.run("stopp", pod_id, check=False)
        self.crictl.run("rmp", pod_id, check=False)

    def timed(self, cid: str, command: str, what: str) -> float:
        """Seconds `command` took in the container, between two adjtimex readings."""
        return parse_loop(self.shell(cid, timed_loop(1, command)), 1, what)[0] / 1e6

    def measure(self, runtime: str) -> dict[str, float]:
        started = time.monotonic()
        volume = self.work / f"volume-{runtime}"
        volume.mkdir()
        empty_dir = volume_dir(self.kubelet, f"empty-{runtime}")
        pod_id, cid = self.pod(runtime, volume, empty_dir)
        figures: dict[str, float] = {}
        try:
            for place, (path, _) in PLACES.items():
                out = self.shell(cid, f"mkdir -p {path} && "
                                      f"{TOOLS}/fsprobe speed {path} {self.files}")
                figures.update({f"{op} {place}": s for op, s in parse_speed(out).items()})
                print(f"{runtime} {place}: " + " ".join(out.split()), flush=True)
                out = self.shell(cid, f"{TOOLS}/sqliteprobe {path} {self.sqlite_rows}")
                figures.update({f"sqlite {op} {place}": s
                                for op, s in parse_sqlite(out).items()})
            figures["untar rootfs"] = self.timed(
                cid, f"mkdir {ROOT_DIR}/x && tar -xf {TOOLS}/files.tar -C {ROOT_DIR}/x",
                f"{runtime} tar")
            figures["rm -rf rootfs"] = self.timed(cid, f"rm -rf {ROOT_DIR}/x",
                                                  f"{runtime} rm -rf")
        finally:
            self.remove(pod_id)
        print(f"{runtime}: {time.monotonic() - started:.0f} s in all", flush=True)
        return figures


def rows(files: int, tar_files: int, sqlite_rows: int) -> list[tuple[str, str]]:
    """(label, figure key) in the table's order."""
    found = []
    for place, (_, where) in PLACES.items():
        found += [(f"create {files} files of 4 KiB, {where}", f"create {place}"),
                  (f"stat {files} files, {where}", f"stat {place}"),
                  (f"unlink {files} files, {where}", f"unlink {place}"),
                  (f"write 64 MiB + fsync, {where}", f"write64 {place}"),
                  (f"read 64 MiB back, {where}", f"read64 {place}"),
                  (f"SQLite {sqlite_rows} inserts, a transaction each, {where}",
                   f"sqlite each {place}"),
                  (f"SQLite {sqlite_rows} inserts in one transaction, {where}",
                   f"sqlite batch {place}")]
    return found + [(f"tar -xf {tar_files} files of 512 B, root fs", "untar rootfs"),
                    (f"rm -rf those {tar_files} files, root fs", "rm -rf rootfs")]


def table(results: dict[str, dict[str, float]], files: int, tar_files: int,
          sqlite_rows: int) -> list[str]:
    names = [r for r in RUNTIMES if r in results]
    labels = rows(files, tar_files, sqlite_rows)
    width = max(len(label) for label, _ in labels)
    head = f"{'operation':<{width}}" + "".join(f"  {n + ' s':>10}" for n in names)
    lines = [head + (f"  {'podvm/runc':>10}" if len(names) == 2 else "")]
    for label, key in labels:
        line = f"{label:<{width}}" + "".join(f"  {results[n][key]:>10.3f}" for n in names)
        if len(names) == 2:
            runc = results["runc"][key]
            line += f"  {results['podvm'][key] / runc if runc else float('nan'):>10.1f}"
        lines.append(line)
    return lines


def daemon(args: argparse.Namespace) -> dict[str, str]:
    """The shim runs elsewhere: a path it can use from anywhere."""
    return {"virtio_fs_daemon": os.path.abspath(args.virtio_fs_daemon)} \
        if args.virtio_fs_daemon else {}


def run(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    results: dict[str, dict[str, float]] = {}
    # in /var/tmp: a tmpfs' emptyDir would be one of medium Memory, which stays the host's
    with tempfile.TemporaryDirectory(prefix="podvm-fs-bench-", dir="/var/tmp") as tmp:
        work = pathlib.Path(tmp)
        tools = work / "tools"
        tools.mkdir()
        build_probe(tools)
        make_tar(tools / "files.tar", args.tar_files)
        config = write_test_config(work / "podvm.toml", accel=args.accel,
                                   template_path=str(work / "templates"),
                                   shared_fs=args.shared_fs,
                                   scratch_disk_mib=args.scratch_disk_mib,
                                   **daemon(args),
                                   runtime={"disable_guest_empty_dir": args.host_empty_dir})
        warm_templates(config)
        ctd = Containerd(work / "containerd", namespace="podvm-fs-bench", cri=True,
                         podvm_config=config)
        with ctd:
            ctd.import_cri_images(work)
            bench = Bench(ctd, Crictl(ctd.cri_endpoint, timeout="120s"), work, tools,
                          args.files, args.sqlite_rows)
            for runtime in args.runtimes:  # one pod at a time: nothing else runs
                results[runtime] = bench.measure(runtime)
        if ctd.forced:
            print(f"warning: the harness had to force its cleanup: {ctd.forced}",
                  file=sys.stderr)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=2000,
                        help="files created, stat'ed and unlinked per place (default 2000)")
    parser.add_argument("--tar-files", type=int, default=10000,
                        help="files in the extracted tar (default 10000)")
    parser.add_argument("--sqlite-rows", type=int, default=200,
                        help="SQLite inserts of each kind (default %(default)s)")
    parser.add_argument("--accel", default="tcg", help="podvm's QEMU accel (default tcg)")
    parser.add_argument("--runtime-only", choices=RUNTIMES, help="measure one runtime")
    parser.add_argument("--shared-fs", choices=SHARED_FS, default=SHARED_FS[0],
                        help="how podvm shares the files (default virtio-fs)")
    parser.add_argument("--scratch-disk-mib", type=int,
                        default=HypervisorConfig.scratch_disk_mib,
                        help="podvm's scratch disk (default %(default)s; 0: the writable "
                             "layers on the host)")
    parser.add_argument("--host-empty-dir", action="store_true",
                        help="podvm shares emptyDirs from the host (disable_guest_empty_dir)")
    parser.add_argument("--virtio-fs-daemon", metavar="PATH",
                        help="podvm's virtiofsd (default: the node's, as the shim picks "
                             "it; build/virtiofsd/virtiofsd: the Rust one `make virtiofsd` "
                             "fetches)")
    parser.add_argument("--json", metavar="FILE", help="also write every figure to FILE")
    args = parser.parse_args()
    if args.files < 1 or args.tar_files < 1 or args.sqlite_rows < 1:
        parser.error("--files, --tar-files and --sqlite-rows must be at least 1")
    args.runtimes = (args.runtime_only,) if args.runtime_only else RUNTIMES
    signal.signal(signal.SIGTERM, terminated)  # unwinds like Ctrl-C: everything removed
    load_before = loadavg()
    results = run(args)
    print()
    print(f"machine: {machine(args.accel)}; podvm's shared_fs {args.shared_fs}, "
          f"scratch_disk_mib {args.scratch_disk_mib}, disable_guest_empty_dir "
          f"{str(args.host_empty_dir).lower()}, virtio_fs_daemon "
          f"{args.virtio_fs_daemon or default_virtio_fs_daemon()}; load "
          f"average {load_before} before, {loadavg()} after")
    print("\n".join(table(results, args.files, args.tar_files, args.sqlite_rows)))
    print("times in seconds, measured in the container (fsprobe: CLOCK_MONOTONIC; "
          "tar and rm: busybox adjtimex around the command); read 64 MiB follows the "
          "write, nothing dropped")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(
            {"machine": machine(args.accel), "files": args.files,
             "tar_files": args.tar_files, "seconds": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # everything is removed by then
        print("fs_bench: interrupted; pods and containerd removed", file=sys.stderr)
        sys.exit(130)
