"""The plan in force on one pod's VM, and each step of it carried out: the sandbox
cgroup's limits, vCPUs and memory hot-plugged, their threads placed, the guest bringing
them online, the vCPUs re-pinned; or put back as they were when a step fails. The Machine
(shim/vm/machine.py) holds one VMResizer, gives it the VM's threads
(shim/cpus/vmthreads.py) and hands it the VM and the agent it acts on."""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Callable

from ..host.podstate import VMReport
from .hypervisor import HypervisorError
from ..resources import PlanDelta

if TYPE_CHECKING:
    from ..host.cgroup import HostCgroup
    from ..cpus.vmthreads import VMThreads
    from ..resources import SandboxPlan
    from .agent import Agent
    from .hypervisor import VM

log = logging.getLogger("podvm.machine")


class VMResizer:
    """The plan in force and what the guest last reported; each change recorded with
    `record` (the Machine's: sandbox.json) before anything acts on it."""

    def __init__(self, sandbox_id: str, plan: SandboxPlan, cgroup: HostCgroup,
                 threads: VMThreads, record: Callable[..., None]) -> None:
        """`cgroup`: the sandbox cgroup, whose limits each step sets; `threads`: where
        the VM's threads run, which each step follows."""
        self.id = sandbox_id
        self.plan = plan
        """The plan in force."""
        self.report: VMReport | None = None
        """What the guest and QEMU said last (_record_vm)."""
        self._cgroup = cgroup
        self._threads = threads
        self._record = record

    async def resize(self, vm: VM, agent: Agent, delta: PlanDelta) -> None:
        """Carry out one step of the plan. A grow raises the cgroup limits first (new
        vCPUs have room to run), hot-plugs the vCPUs not already present and the memory,
        places the new threads and has the guest bring exactly the plan's vCPUs online;
        a shrink takes vCPUs offline in the guest (they stay plugged, their threads
        asleep: see add_vcpus in shim/vm/qemu/hotplug.py), then lowers the limits. A
        failure puts back the limits and online vCPUs in force before; hot-plugged memory
        cannot be taken back and is recorded as the VM's. Either way the plan then in
        force is recorded and the vCPUs pinned to it."""
        old = self.plan
        for note in delta.notes:
            log.info("sandbox %s: %s", self.id, note)
        added_mib = 0
        failure: BaseException | None = None
        try:
            if delta.grows:
                self._cgroup.apply(delta.plan)
            present, _ = await vm.size()
            if delta.plan.vcpus > present:
                await vm.add_vcpus(delta.plan.vcpus - present)
                await self._threads.place_new(vm)
            if delta.add_memory_mib:
                await vm.add_memory(delta.add_memory_mib)
                added_mib = delta.add_memory_mib
            if delta.add_vcpus or delta.remove_vcpus or added_mib:
                await self._online(vm, agent, delta.plan.vcpus, added_mib)
            if not delta.grows:
                self._cgroup.apply(delta.plan)
            in_force = delta.plan
        except BaseException as exc:
            log.error("sandbox %s: resize failed (%s); back to the plan in force", self.id, exc)
            in_force = dataclasses.replace(
                old, memory_mib=old.memory_mib + added_mib,
                cgroup_memory_limit=old.cgroup_memory_limit + (added_mib << 20)
                if old.cgroup_memory_limit > 0 else old.cgroup_memory_limit)
            try:
                self._cgroup.apply(in_force)
                await self._online(vm, agent, in_force.vcpus, 0)
            except Exception as undo:
                log.error("sandbox %s: could not restore the plan in force: %s", self.id, undo)
            failure = exc
        self.plan = in_force
        self._record(plan=in_force)
        await self._threads.pin(vm, in_force)
        if failure is not None:
            raise failure

    async def fit_booted(self, vm: VM, agent: Agent, online_cpus: int,
                         memory_total_bytes: int, restored: bool) -> None:
        """The VM up: what its guest reports (`online_cpus`, `memory_total_bytes`) and
        QEMU's size recorded; a VM `restored` from its class's template
        (shim/vm/template/template.py, base_of) then grown to the plan's vCPUs and memory
        by the hot-plug of resize(), before any container runs (one already the plan's
        size is left as it is)."""
        self._record_vm(online_cpus, memory_total_bytes, await vm.size())
        vcpus, memory = vm.spec.vcpus, vm.spec.memory_mib
        if not restored or (vcpus, memory) == (self.plan.vcpus, self.plan.memory_mib):
            return
        started = time.monotonic()
        await self.resize(vm, agent, PlanDelta(plan=self.plan,
                                               add_vcpus=self.plan.vcpus - vcpus,
                                               add_memory_mib=self.plan.memory_mib - memory))
        log.info("sandbox %s: restored at %d vCPUs and %d MiB, grown to %d and %d MiB in "
                 "%.2fs", self.id, vcpus, memory, self.plan.vcpus, self.plan.memory_mib,
                 time.monotonic() - started)

    def _record_vm(self, online_cpus: int, memory_total_bytes: int,
                   qemu_size: tuple[int, int]) -> None:
        """What the guest reports it has and what QEMU says it gave (vCPUs present,
        memory), next to the plan, for `podvmctl status` (which cannot ask QMP: the
        shim holds its only connection)."""
        qemu_vcpus, qemu_memory_mib = qemu_size
        self.report = VMReport(online_cpus=online_cpus,
                               memory_total_mib=memory_total_bytes >> 20, at=time.time(),
                               qemu_vcpus=qemu_vcpus, qemu_memory_mib=qemu_memory_mib)
        self._record(vm=self.report)

    async def _online(self, vm: VM, agent: Agent, vcpus: int, added_mib: int) -> None:
        """Exactly `vcpus` online in the guest, and `added_mib` more memory."""
        before = (self.report.memory_total_mib if self.report else 0) << 20
        info = await agent.online(
            cpus=vcpus, wait_memory_bytes=before + (added_mib << 20) if added_mib else 0)
        self._record_vm(info.online_cpus, info.memory_total_bytes, await vm.size())
        if info.online_cpus != vcpus:
            raise HypervisorError(f"the guest has {info.online_cpus} vCPUs online, not "
                                  f"{vcpus}")
        if added_mib and info.memory_total_bytes < before + (added_mib << 20):
            raise HypervisorError(f"the guest onlined {(info.memory_total_bytes - before) >> 20}"
                                  f" of {added_mib} MiB hot-plugged")
