"""vCPUs and memory added to a running QEMU VM over QMP (the guest onlines them), and the
virtio-fs device to a restored one. Nothing is ever unplugged: see add_vcpus and
add_memory."""
from __future__ import annotations

from qemu.qmp import ExecuteError

from ...resources.update import MEMORY_BLOCK_MIB
from ..hypervisor import CannotGrow, HypervisorError
from . import command, query
from .query import Execute


async def add_vcpus(execute: Execute, count: int) -> list[int]:
    """Hot-plug `count` vCPUs into free slots (ACPI CPU hot-plug; the guest onlines
    them); their host thread ids. There is no unplug: after a device_del of a vCPU,
    QEMU 7.2 under TCG crashes (double free) on its next device_add, so a VM shrinks
    by taking vCPUs offline in the guest instead (their threads then sleep). Under
    TCG there is no free slot: every vCPU is plugged at boot (shim/vm/qemu/command.py)."""
    slots = await execute("query-hotpluggable-cpus")
    free = sorted((s for s in slots if "qom-path" not in s),  # type: ignore[union-attr]
                  key=lambda s: tuple(sorted(s["props"].items())))
    if count > len(free):
        raise CannotGrow(f"cannot add {count} vCPUs: only {len(free)} of "
                         f"{len(slots)} slots are free (maxcpus)")  # type: ignore[arg-type]
    present = await execute("query-cpus-fast")
    before = {c["thread-id"] for c in present}  # type: ignore[union-attr]
    try:
        for slot in free[:count]:
            props = dict(slot["props"])
            device_id = "vcpu-" + "-".join(str(props[k]) for k in sorted(props))
            await execute("device_add", {"driver": slot["type"], "id": device_id, **props})
    except ExecuteError as exc:
        raise CannotGrow(f"vCPU hot-plug refused by QEMU: {exc}") from None
    after = await execute("query-cpus-fast")
    return sorted(c["thread-id"] for c in after  # type: ignore[union-attr]
                  if c["thread-id"] not in before)


async def add_memory(execute: Execute, mib: int, max_memory_mib: int) -> int:
    """Hot-plug `mib` MiB as one pc-dimm (the guest onlines its blocks), up to
    `max_memory_mib` in all; MiB added. Memory is never taken back: a guest cannot be
    trusted to give it up."""
    if mib <= 0 or mib % MEMORY_BLOCK_MIB:
        raise CannotGrow(f"memory hot-plug takes multiples of {MEMORY_BLOCK_MIB} "
                         f"MiB, not {mib}")
    _, total = await query.size(execute)
    if total + mib > max_memory_mib:
        raise CannotGrow(f"cannot add {mib} MiB: the VM has {total} MiB and may "
                         f"grow to {max_memory_mib} MiB (maxmem)")
    dimms = [d for d in await execute("query-memory-devices")]  # type: ignore[union-attr]
    name = f"mem{len(dimms)}"
    try:
        # Shared as the boot RAM is: virtiofsd reads and writes guest buffers anywhere.
        await execute("object-add", {"qom-type": "memory-backend-memfd", "id": name,
                                     "size": mib << 20, "share": True})
    except ExecuteError as exc:
        raise CannotGrow(f"memory hot-plug of {mib} MiB refused by QEMU: {exc}") from None
    try:
        await execute("device_add", {"driver": "pc-dimm", "id": f"dimm{len(dimms)}",
                                     "memdev": name})
    except ExecuteError as exc:
        await execute("object-del", {"id": name})
        raise CannotGrow(f"memory hot-plug of {mib} MiB refused by QEMU: {exc}") from None
    return mib


async def add_virtio_fs(execute: Execute, workdir: str) -> None:
    """The virtio-fs device and its socket to virtiofsd, added to a VM restored from a
    template (which has the root port for it: shim/vm/qemu/command.py)."""
    try:
        await execute("chardev-add", command.virtio_fs_chardev(workdir))
        await execute("device_add", command.virtio_fs_device())
    except ExecuteError as exc:
        raise HypervisorError(f"QEMU refused the virtio-fs device: {exc}") from None
