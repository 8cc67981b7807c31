"""Is everything a pod's VM uses on the host charged to the pod? A container burns CPU
and writes files for a while; then QEMU's own CPU time and memory (from /proc) are set
beside what its sandbox cgroup was charged (cpuacct, memory). Target: cgroup CPU >= 99%
of QEMU's, cgroup memory >= QEMU's anonymous memory (guest RAM and QEMU's heap; file
pages of the QEMU binary are charged to whoever read them first).

usage: python bench/accounting_bench.py [--seconds S] [--rounds N]
"""
from __future__ import annotations

import argparse
import asyncio
import pathlib
import sys
import tempfile
import uuid

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from podvm_core.pb.containerd.task.v2 import shim_pb2 as api  # noqa: E402
from testbed.hostcgroup import charged, sandbox_state  # noqa: E402
from testbed.taskshim import (Fifos, busybox_rootfs, call, create, task_shim,  # noqa: E402
                              workload_bundle)

BUSY = ("while :; do :; done & "
        "while :; do dd if=/dev/zero of=/f bs=64k count=200 2>/dev/null; sync; done & "
        "echo busy; wait")


async def run(seconds: float, rounds: int) -> None:
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="podvm-accounting-"))
    rootfs = busybox_rootfs(tmp / "rootfs")
    parent = f"/podvm-bench-{uuid.uuid4().hex[:8]}"
    async with task_shim(tmp, rootfs, cgroups_path=f"{parent}/sb") as pod:
        qemu_pid = sandbox_state()["qemu_pid"]
        fifos = Fifos(tmp, "busy")
        await create(pod, "busy", workload_bundle(pod, "busy", args=["sh", "-c", BUSY]), fifos)
        await call(pod, "Start", api.StartRequest(id="busy"), api.StartResponse)
        await fifos.read(fifos.out, b"busy", timeout=60)
        print(f"{'after':>6}  {'QEMU CPU s':>10}  {'cgroup CPU s':>12}  {'ratio':>7}  "
              f"{'QEMU RSS':>8}  {'QEMU anon':>9}  {'cgroup mem':>10}  (MiB)")
        for i in range(1, rounds + 1):
            await asyncio.sleep(seconds)
            f = charged(qemu_pid, f"{parent}/podvm_sb")
            print(f"{i * seconds:>5.0f}s  {f['qemu_cpu_s']:>10}  {f['cgroup_cpu_s']:>12}  "
                  f"{f['cpu_ratio']:>7}  {f['qemu_rss_mib']:>8}  {f['qemu_anon_mib']:>9}  "
                  f"{f['cgroup_memory_mib']:>10}")
        await call(pod, "Kill", api.KillRequest(id="busy", signal=9, all=True))
        await call(pod, "Wait", api.WaitRequest(id="busy"), api.WaitResponse)
        await call(pod, "Delete", api.DeleteRequest(id="busy"), api.DeleteResponse)
    for mountpoint in pathlib.Path("/sys/fs/cgroup").iterdir():
        leftover = mountpoint / parent.strip("/")
        if leftover.is_dir():
            leftover.rmdir()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=5, help="seconds between readings")
    p.add_argument("--rounds", type=int, default=3, help="readings to print")
    args = p.parse_args()
    asyncio.run(run(args.seconds, args.rounds))


if __name__ == "__main__":
    main()
