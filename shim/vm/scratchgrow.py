"""A pod's scratch disk once its guest is up (booted or restored), as its Machine
(shim/vm/machine.py) holds it: its inode recorded for the node's accounts
(shim/host/diskreserve.py); grown to its plan's size (every disk starts as the one blank
file system, shim/vm/scratchdisk.py, so that templates do not differ by disk size: QEMU
resizes the device, its file grows sparse, and the guest's agent grows the mounted ext4
online to fill it, guest/agent/scratchgrow.py); shown where kubelet counts a pod's files
(shim/host/podlogdisk.py) until the VM stops."""
from __future__ import annotations

import logging
import os
import time
from typing import Callable

from podvm_core.ttrpc import Code, TtrpcError

from ..host import podlogdisk
from ..resources.storage import BLANK_MIB
from .agent import Agent
from .hypervisor import VM, StaleGuest

log = logging.getLogger("podvm.scratch")
MIB = 1 << 20


class VMScratch:
    """The scratch disk of one pod's VM, its inode recorded with `record` (the Machine's:
    sandbox.json) before the disk is grown."""

    def __init__(self, sandbox_id: str, log_directory: str,
                 record: Callable[..., None]) -> None:
        """`log_directory`: kubelet's directory of the pod's logs, where the disk is
        shown ("": nowhere)."""
        self.id = sandbox_id
        self._log_directory = log_directory
        self._record = record
        self._shown: podlogdisk.Shown | None = None

    async def grow_and_show(self, vm: VM, agent: Agent, disk_mib: int) -> None:
        """`vm`'s disk recorded, grown to `disk_mib` through `agent` and shown."""
        disk = path(vm)
        self._record(scratch_inode=os.stat(disk).st_ino)
        await grow(vm, agent, disk_mib)
        if self._log_directory:
            self._shown = podlogdisk.show(disk, self._log_directory, self.id)

    def hide(self) -> None:
        """The disk's name in the log directory removed (its blocks free with its last
        name); idempotent."""
        shown, self._shown = self._shown, None
        podlogdisk.hide(shown)


def path(vm: VM) -> str:
    """The scratch disk `vm`'s QEMU holds, as its descriptor (the number it was given,
    VMSpec.scratch_disk) under /proc."""
    return f"/proc/{vm.pid}/fd/{vm.spec.scratch_disk.removeprefix('/proc/self/fd/')}"


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
