"""One step of a pod's plan carried out on its Machine (shim/vm/machine.py, which this
is a part of): the sandbox cgroup's limits, vCPUs and memory hot-plugged, the guest
bringing them online, the vCPUs re-pinned; or put back as they were when a step fails."""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING

from podvm_core.cpulist import format_cpu_list, parse_cpu_list

from ..cpus import pinning
from .hypervisor import HypervisorError, ThreadRole
from ..resources import PlanDelta

if TYPE_CHECKING:
    from ..config import Config
    from ..host.cgroup import HostCgroup
    from ..host.podstate import PodState
    from ..resources import SandboxPlan
    from .agent import Agent
    from .hypervisor import VM

log = logging.getLogger("podvm.machine")


class MachineResize:
    """The Machine's plan carried out (a part of Machine: its state is the Machine's)."""

    id: str
    config: Config
    plan: SandboxPlan
    cgroup: HostCgroup
    vm: VM | None
    agent: Agent | None
    state: PodState
    vcpu_pins: list[frozenset[int]]
    # and record(), record_plan(), record_vm() (shim/vm/machine.py)

    async def resize(self, delta: PlanDelta) -> None:
        """Carry out one step of the plan. A grow raises the cgroup limits first (new
        vCPUs have room to run), hot-plugs the vCPUs not already present and the memory,
        places the new threads and has the guest bring exactly the plan's vCPUs online;
        a shrink takes vCPUs offline in the guest (they stay plugged, their threads
        asleep: see add_vcpus in shim/vm/qemu_hotplug.py), then lowers the limits. A
        failure puts back the limits and online vCPUs in force before; hot-plugged memory
        cannot be taken back and is recorded as the VM's."""
        assert self.vm is not None and self.agent is not None
        old = self.plan
        for note in delta.notes:
            log.info("sandbox %s: %s", self.id, note)
        added_mib = 0
        try:
            if delta.grows:
                self.cgroup.apply(delta.plan)
            present, _ = await self.vm.size()
            if delta.plan.vcpus > present:
                await self.vm.add_vcpus(delta.plan.vcpus - present)
                await self.cgroup.place_new(self.vm)
            if delta.add_memory_mib:
                await self.vm.add_memory(delta.add_memory_mib)
                added_mib = delta.add_memory_mib
            if delta.add_vcpus or delta.remove_vcpus or added_mib:
                await self._online(delta.plan.vcpus, added_mib)
            if not delta.grows:
                self.cgroup.apply(delta.plan)
        except BaseException as exc:
            log.error("sandbox %s: resize failed (%s); back to the plan in force", self.id, exc)
            kept = dataclasses.replace(
                old, memory_mib=old.memory_mib + added_mib,
                cgroup_memory_limit=old.cgroup_memory_limit + (added_mib << 20)
                if old.cgroup_memory_limit > 0 else old.cgroup_memory_limit)
            try:
                self.cgroup.apply(kept)
                await self._online(kept.vcpus, 0)
            except Exception as undo:
                log.error("sandbox %s: could not restore the plan in force: %s", self.id, undo)
            self.record_plan(kept)
            await self.pin()
            raise
        self.record_plan(delta.plan)
        await self.pin()


    async def grow_restored(self) -> None:
        """A VM restored from its class's template (shim/vm/template.py, base_of) grown
        to the plan's vCPUs and memory by the hot-plug of resize(), before any container
        runs; one already the plan's size is left as it is."""
        assert self.vm is not None
        vcpus, memory = self.vm.spec.vcpus, self.vm.spec.memory_mib
        if (vcpus, memory) == (self.plan.vcpus, self.plan.memory_mib):
            return
        started = time.monotonic()
        await self.resize(PlanDelta(plan=self.plan, add_vcpus=self.plan.vcpus - vcpus,
                                    add_memory_mib=self.plan.memory_mib - memory))
        log.info("sandbox %s: restored at %d vCPUs and %d MiB, grown to %d and %d MiB in "
                 "%.2fs", self.id, vcpus, memory, self.plan.vcpus, self.plan.memory_mib,
                 time.monotonic() - started)

    async def pin(self) -> None:
        """vCPU threads on the pod's cpuset (no cpuset: the CPUs its cgroup allows): 1:1
        when enable_vcpus_pinning and the online vCPUs and the CPUs are as many, else
        floating over the set. Done after every change: an affinity set here outlives
        a later, wider cpuset (Linux keeps the user's mask), so it is always rewritten."""
        assert self.vm is not None
        cpuset = parse_cpu_list(self.plan.cpuset) if self.plan.cpuset else \
            self.cgroup.vcpu_cpus()
        vcpus = (await self.vm.threads()).get(ThreadRole.VCPU, [])
        pins = pinning.pin_map(vcpus, self.plan.vcpus, cpuset,
                               self.config.runtime.enable_vcpus_pinning)
        pinning.apply(pins, owner=self.vm.pid)
        self.vcpu_pins = [pins.get(t, frozenset()) for t in vcpus[:self.plan.vcpus]]
        self.record(vcpu_pins=tuple(format_cpu_list(p) for p in self.vcpu_pins))
        if pins:
            log.info("sandbox %s: vCPUs on host CPUs %s", self.id,
                     ", ".join(f"{i}->{format_cpu_list(p)}"
                               for i, p in enumerate(self.vcpu_pins)))


    async def _online(self, vcpus: int, added_mib: int) -> None:
        """Exactly `vcpus` online in the guest, and `added_mib` more memory."""
        assert self.agent is not None
        before = (self.state.vm.memory_total_mib if self.state.vm else 0) << 20
        info = await self.agent.online(
            cpus=vcpus, wait_memory_bytes=before + (added_mib << 20) if added_mib else 0)
        assert self.vm is not None
        self.record_vm(info.online_cpus, info.memory_total_bytes, await self.vm.size())
        if info.online_cpus != vcpus:
            raise HypervisorError(f"the guest has {info.online_cpus} vCPUs online, not "
                                  f"{vcpus}")
        if added_mib and info.memory_total_bytes < before + (added_mib << 20):
            raise HypervisorError(f"the guest onlined {(info.memory_total_bytes - before) >> 20}"
                                  f" of {added_mib} MiB hot-plugged")
