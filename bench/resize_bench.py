"""How fast a running pod follows a resource change, under TCG.

- Task.Update to applied: a container's CPU quota and memory limit changed through the
  Task API (as containerd's CRI does for `crictl update`), within the VM's size: the
  answer comes once the host sandbox cgroup and the guest's container cgroup have it.
- vCPU hot-plug until the guest sees it: QMP device_add to the guest reporting the CPU
  online; and 256 MiB of memory the same way.

usage: python bench/resize_bench.py [--updates N] [--hotplugs N]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from podvm_core.pb.containerd.task.v2 import shim_pb2 as api  # noqa: E402
from shim.vm.agent import Agent  # noqa: E402
from shim.vm.hypervisor import VMSpec  # noqa: E402
from shim.vm.qemu.driver import QemuVM  # noqa: E402
from testbed.taskshim import (Fifos, busybox_rootfs, call, create, task_shim,  # noqa: E402
                              workload_bundle)
from testbed.vmconfig import vm_config  # noqa: E402

LINUX_RESOURCES = "types.containerd.io/opencontainers/runtime-spec/1/LinuxResources"


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


async def updates(n: int) -> list[float]:
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="podvm-resize-"))
    rootfs = busybox_rootfs(tmp / "rootfs")
    times = []
    async with task_shim(tmp, rootfs, default_maxvcpus=2) as pod:
        fifos = Fifos(tmp, "c")
        bundle = workload_bundle(pod, "c", args=["sleep", "1000"], memory=128 << 20)
        await create(pod, "c", bundle, fifos)
        await call(pod, "Start", api.StartRequest(id="c"), api.StartResponse)
        for i in range(n):
            quota = 20_000 + 10_000 * (i % 5)  # within the VM's vCPUs: no hot-plug
            req = api.UpdateTaskRequest(id="c")
            req.resources.type_url = LINUX_RESOURCES
            req.resources.value = json.dumps({"cpu": {"quota": quota, "period": 100_000},
                                              "memory": {"limit": 128 << 20}}).encode()
            started = time.perf_counter()
            await call(pod, "Update", req)
            times.append(time.perf_counter() - started)
        await call(pod, "Kill", api.KillRequest(id="c", signal=9))
        await call(pod, "Wait", api.WaitRequest(id="c"), api.WaitResponse)
        await call(pod, "Delete", api.DeleteRequest(id="c"), api.DeleteResponse)
    return times


async def hotplugs(n: int) -> tuple[list[float], list[float]]:
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="podvm-hotplug-"))
    (tmp / "shared").mkdir()
    spec = VMSpec(sandbox_id="hotplug-bench", workdir=str(tmp / "vm"),
                  shared_dir=str(tmp / "shared"), vcpus=1, max_vcpus=1 + n, memory_mib=256,
                  max_memory_mib=256 + 256 * n, hypervisor=vm_config(boot_timeout=90).qemu)
    vm = QemuVM(spec)
    await vm.launch()
    cpu_times, mem_times = [], []
    try:
        agent = Agent.of_vm(vm)
        info = await agent.ping(timeout=60)
        memory = info.memory_total_bytes
        for i in range(n):
            started = time.perf_counter()
            await vm.add_vcpus(1)
            await agent.online(cpus=2 + i)
            cpu_times.append(time.perf_counter() - started)
            started = time.perf_counter()
            await vm.add_memory(256)
            memory = (await agent.online(cpus=2 + i, wait_memory_bytes=memory + (256 << 20))
                      ).memory_total_bytes
            mem_times.append(time.perf_counter() - started)
        await agent.close()
    finally:
        await vm.stop()
    return cpu_times, mem_times


def ms(values: list[float]) -> str:
    return (f"p50 {statistics.median(values) * 1000:7.1f} ms  p99 {pct(values, 99) * 1000:7.1f}"
            f" ms  ({len(values)} runs)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--updates", type=int, default=50, help="Task.Update calls to time")
    p.add_argument("--hotplugs", type=int, default=3, help="vCPU and memory hot-plugs")
    args = p.parse_args()
    up = asyncio.run(updates(args.updates))
    cpu, mem = asyncio.run(hotplugs(args.hotplugs))
    print(f"Task.Update to applied (host + guest cgroups)  {ms(up)}")
    print(f"vCPU hot-plug until the guest has it online    {ms(cpu)}")
    print(f"256 MiB hot-plug until the guest has it online {ms(mem)}")


if __name__ == "__main__":
    main()
