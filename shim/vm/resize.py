"""One step of a pod's plan carried out on its Machine (shim/vm/machine.py): the sandbox
cgroup's limits, vCPUs and memory hot-plugged, the guest bringing them online, the vCPUs
re-pinned; or put back as they were when a step fails."""
from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

from podvm_core.cpulist import format_cpu_list, parse_cpu_list

from ..cpus import pinning
from .hypervisor import HypervisorError, ThreadRole
from ..resources import PlanDelta

if TYPE_CHECKING:
    from .machine import Machine

log = logging.getLogger("podvm.machine")


async def resize(machine: Machine, delta: PlanDelta) -> None:
    """Carry out one step of the plan. A grow raises the cgroup limits first (new
    vCPUs have room to run), hot-plugs the vCPUs not already present and the memory,
    places the new threads and has the guest bring exactly the plan's vCPUs online;
    a shrink takes vCPUs offline in the guest (they stay plugged, their threads
    asleep: see add_vcpus in shim/vm/qemu_hotplug.py), then lowers the limits. A
    failure puts back the limits and online vCPUs in force before; hot-plugged memory
    cannot be taken back and is recorded as the VM's."""
    assert machine.vm is not None and machine.agent is not None
    old = machine.plan
    for note in delta.notes:
        log.info("sandbox %s: %s", machine.id, note)
    added_mib = 0
    try:
        if delta.grows:
            machine.cgroup.apply(delta.plan)
        present, _ = await machine.vm.size()
        if delta.plan.vcpus > present:
            await machine.vm.add_vcpus(delta.plan.vcpus - present)
            await machine.cgroup.place_new(machine.vm)
        if delta.add_memory_mib:
            await machine.vm.add_memory(delta.add_memory_mib)
            added_mib = delta.add_memory_mib
        if delta.add_vcpus or delta.remove_vcpus or added_mib:
            await _online(machine, delta.plan.vcpus, added_mib)
        if not delta.grows:
            machine.cgroup.apply(delta.plan)
    except BaseException as exc:
        log.error("sandbox %s: resize failed (%s); back to the plan in force", machine.id, exc)
        kept = dataclasses.replace(
            old, memory_mib=old.memory_mib + added_mib,
            cgroup_memory_limit=old.cgroup_memory_limit + (added_mib << 20)
            if old.cgroup_memory_limit > 0 else old.cgroup_memory_limit)
        try:
            machine.cgroup.apply(kept)
            await _online(machine, kept.vcpus, 0)
        except Exception as undo:
            log.error("sandbox %s: could not restore the plan in force: %s", machine.id, undo)
        machine.record_plan(kept)
        await pin(machine)
        raise
    machine.record_plan(delta.plan)
    await pin(machine)


async def pin(machine: Machine) -> None:
    """vCPU threads on the pod's cpuset (no cpuset: the CPUs its cgroup allows): 1:1
    when enable_vcpus_pinning and the online vCPUs and the CPUs are as many, else
    floating over the set. Done after every change: an affinity set here outlives
    a later, wider cpuset (Linux keeps the user's mask), so it is always rewritten."""
    assert machine.vm is not None
    cpuset = parse_cpu_list(machine.plan.cpuset) if machine.plan.cpuset else \
        machine.cgroup.vcpu_cpus()
    vcpus = (await machine.vm.threads()).get(ThreadRole.VCPU, [])
    pins = pinning.pin_map(vcpus, machine.plan.vcpus, cpuset,
                           machine.config.runtime.enable_vcpus_pinning)
    pinning.apply(pins)
    machine.vcpu_pins = [pins.get(t, frozenset()) for t in vcpus[:machine.plan.vcpus]]
    machine.record(vcpu_pins=tuple(format_cpu_list(p) for p in machine.vcpu_pins))
    if pins:
        log.info("sandbox %s: vCPUs on host CPUs %s", machine.id,
                 ", ".join(f"{i}->{format_cpu_list(p)}"
                           for i, p in enumerate(machine.vcpu_pins)))


async def _online(machine: Machine, vcpus: int, added_mib: int) -> None:
    """Exactly `vcpus` online in the guest, and `added_mib` more memory."""
    assert machine.agent is not None
    before = (machine.state.vm.memory_total_mib if machine.state.vm else 0) << 20
    info = await machine.agent.online(
        cpus=vcpus, wait_memory_bytes=before + (added_mib << 20) if added_mib else 0)
    assert machine.vm is not None
    machine.record_vm(info.online_cpus, info.memory_total_bytes, await machine.vm.size())
    if info.online_cpus != vcpus:
        raise HypervisorError(f"the guest has {info.online_cpus} vCPUs online, not "
                              f"{vcpus}")
    if added_mib and info.memory_total_bytes < before + (added_mib << 20):
        raise HypervisorError(f"the guest onlined {(info.memory_total_bytes - before) >> 20}"
                              f" of {added_mib} MiB hot-plugged")
