"""A pod's scratch disk grown to its plan's size once its guest is up (booted or restored):
every disk starts as the one blank file system (shim/vm/scratchdisk.py) so that templates
do not differ by disk size; QEMU resizes the device (its file grows, sparse) and the
guest's agent grows the mounted ext4 online to fill it (guest/agent/scratchgrow.py)."""
from __future__ import annotations

import logging
import os
import time

from podvm_core.ttrpc import Code, TtrpcError

from ..resources.storage import BLANK_MIB
from .agent import Agent
from .hypervisor import VM, StaleGuest

log = logging.getLogger("podvm.scratch")
MIB = 1 << 20


def path(vm: VM) -> str:
    """The scratch disk `vm`'s QEMU holds, as its descriptor (the number it was given,
    VMSpec.scratch_disk) under /proc."""
    return f"/proc/{vm.pid}/fd/{vm.spec.scratch_disk.removeprefix('/proc/self/fd/')}"


def inode(vm: VM) -> int:
    """The inode of the scratch disk `vm`'s QEMU holds, for the node's accounts
    (shim/host/diskreserve.py)."""
    return os.stat(path(vm)).st_ino


async def grow(vm: VM, agent: Agent, disk_mib: int) -> float:
    """Seconds it took (0 for a disk the blank's size already)."""
    if disk_mib <= BLANK_MIB:
        return 0.0
    started = time.monotonic()
    await vm.resize_scratch(disk_mib * MIB)
    try:
        size = await agent.grow_scratch(disk_mib * MIB)
    except TtrpcError as exc:
        if exc.code != Code.UNIMPLEMENTED:
            raise
        raise StaleGuest(f"the guest image is older than the shim: its agent cannot grow "
                         f"the scratch disk to the pod's {disk_mib} MiB (GrowScratch); "
                         f"rebuild the guest") from None
    took = time.monotonic() - started
    log.info("sandbox %s: scratch disk grown to %d MiB (file system %d MiB) in %.2fs",
             vm.spec.sandbox_id, disk_mib, size // MIB, took)
    return took
