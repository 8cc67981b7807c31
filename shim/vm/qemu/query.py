"""What a running QEMU VM has, asked over QMP: its size (vCPUs present, memory) and its
host threads by role. A thread id QMP reports is QEMU's word, and a guest that took QEMU
over can make it name any thread of the host (containerd's, another pod's vCPUs): the
ids are checked against QEMU's own threads in /proc before the shim places or pins one."""
from __future__ import annotations

from typing import Awaitable, Callable

import psutil

from ..hypervisor import HypervisorError, ThreadRole

Execute = Callable[..., Awaitable[object]]
"""One QMP command (name, arguments) as QemuVM._execute runs it: QEMU gone raises how
it ended."""


async def size(execute: Execute) -> tuple[int, int]:
    """vCPUs present and memory (MiB, boot + DIMMs) as QEMU reports them now; the
    root image's virtio-pmem is plugged memory to QEMU, not RAM."""
    cpus = await execute("query-cpus-fast")
    memory = await execute("query-memory-size-summary")
    devices = await execute("query-memory-devices")
    dimms = sum(d["data"]["size"] for d in devices  # type: ignore[union-attr,index]
                if d["type"] == "dimm")  # type: ignore[index]
    return len(cpus), (memory["base-memory"] + dimms) >> 20  # type: ignore[index,arg-type]


async def threads(execute: Execute, pid: int) -> dict[ThreadRole, list[int]]:
    """Every thread of QEMU (process `pid`) by role, vCPUs in vCPU index order;
    psutil.NoSuchProcess when QEMU is gone; HypervisorError naming them when QMP
    reports thread ids that are not QEMU's own (/proc/`pid`/task)."""
    cpus = await execute("query-cpus-fast")
    iothreads = await execute("query-iothreads")
    roles: dict[ThreadRole, list[int]] = {  # vCPUs in vCPU index order
        ThreadRole.VCPU: [c["thread-id"] for c in sorted(  # type: ignore[index]
            cpus, key=lambda c: c["cpu-index"])],  # type: ignore[index,arg-type]
        ThreadRole.IOTHREAD: [t["thread-id"] for t in iothreads],  # type: ignore[index,union-attr]
        ThreadRole.MAIN: [pid],
    }
    known = {tid for tids in roles.values() for tid in tids}
    tasks = [t.id for t in psutil.Process(pid).threads()]
    foreign = sorted(t for t in known if t not in tasks)
    if foreign:
        raise HypervisorError(f"QEMU (pid {pid}) reported thread ids that are not its own "
                              f"(not in /proc/{pid}/task): {', '.join(map(str, foreign))}; "
                              f"none is placed or pinned")
    roles[ThreadRole.OTHER] = sorted(t for t in tasks if t not in known)
    return roles
