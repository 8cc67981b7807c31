"""The pod's plan in force and every change of it: re-plan with the pure model
(shim/resources/planner.py), apply the step on the Machine (host cgroup limits, vCPUs and
memory hot-plugged, vCPUs re-pinned), the guest's cpusets following, commit; or put back
the plan in force. And the CPUs the pod reserves for itself (cpu_reservation =
"exclusive"). The Pod (shim/pod/pod.py) holds one Resizer, and gives it the pod's VMSlot
(shim/pod/vmslot.py) and its containers (shim/pod/containers.py), whose cpusets in the
guest follow the vCPUs."""
from __future__ import annotations

import asyncio
import json
import logging
from typing import TYPE_CHECKING

from podvm_core.cpulist import parse_cpu_list
from podvm_core.ttrpc import TtrpcError

import cgroups

from ..cpus.allocator import Allocator
from ..cpus.pinning import guest_cpus_for_update
from ..resources import ContainerResources, PlanError, StaticSizeExceeded
from ..resources.planner import PodPlanner, parse_linux_resources
from ..vm import guestspec
from ..vm.hypervisor import HypervisorError
from .errors import Refused, StaticRefusal, StepFailed

if TYPE_CHECKING:
    from ..config import Config
    from ..vm.agent import Agent
    from .containers import Containers
    from .vmslot import VMSlot

log = logging.getLogger("podvm.pod")


class Resizer:
    """The pod's planner, the node's CPU allocator while the pod holds CPUs of it, and
    the lock that makes the plan's changes one at a time."""

    def __init__(self, pod_id: str, config: Config, planner: PodPlanner, vm: VMSlot,
                 containers: Containers) -> None:
        self.id = pod_id
        self.planner = planner
        self.allocator: Allocator | None = None
        """The node's CPU allocator, while the pod holds CPUs of it (reserve_cpus)."""
        self._config = config
        self._vm = vm
        self._containers = containers
        self._applying = asyncio.Lock()

    async def apply(self, container_id: str | None, resources: ContainerResources | None,
                    quiet: bool = False, totals: ContainerResources | None = None) -> None:
        """Re-plan with `container_id` at `resources` (None: gone; no id: the pod's own
        `totals`, or the shared CPU pool, changed) and apply the step: host cgroup limits,
        vCPUs and memory hot-plugged, vCPUs re-pinned, the guest's cpusets following.
        All or nothing: on failure the plan in force stays. Growth a static-mode VM
        cannot take is the exception: what fits (limits, cpuset) is applied, then
        StaticRefusal is raised. `quiet`: failures are logged only (cleanup)."""
        machine, planner = self._vm.machine, self.planner
        if machine is None:
            return
        async with self._applying:
            containers, base = self._inputs(container_id, resources, totals)
            refusal = None
            try:
                try:
                    delta = planner.update(machine.plan, containers, base)
                except StaticSizeExceeded as exc:
                    if exc.fitting is None:
                        raise
                    refusal, delta = exc, exc.fitting  # apply what fits, then refuse
                pins = list(machine.vcpu_pins)
                if delta.plan != machine.plan:
                    try:
                        await machine.resize(delta)
                    except (HypervisorError, cgroups.CgroupError) as exc:
                        raise StepFailed(f"resizing sandbox {self.id}", exc) from None
            except (TtrpcError, StepFailed, PlanError) as exc:
                if not quiet:
                    raise
                log.warning("sandbox %s: re-plan without %s: %s", self.id, container_id,
                            exc.message if isinstance(exc, TtrpcError) else exc)
                return
            planner.commit(containers, base)
            if pins != machine.vcpu_pins:
                await self._confine(skip=container_id)
            if refusal is not None:
                raise StaticRefusal(f"{refusal} (applied what fits in the VM: "
                                    f"{'; '.join(delta.notes)})")

    def _inputs(self, container_id: str | None, resources: ContainerResources | None,
                totals: ContainerResources | None
                ) -> tuple[dict[str, ContainerResources], ContainerResources | None]:
        """The containers' resources and the pod's totals the change asks for."""
        containers, base = dict(self.planner.containers), totals
        if container_id is None:
            pass
        elif container_id == self.id:  # ctr run: the container is its own pod
            base = resources or ContainerResources()
        elif resources is None:
            containers.pop(container_id, None)
        else:
            containers[container_id] = resources
        return containers, base

    async def update_container(self, container_id: str, linux_resources: bytes) -> None:
        """Task.Update with OCI LinuxResources JSON: the host first (the guest gets room
        to grow), then the container's own limits in the guest; the host goes back if
        the guest refuses. A static refusal still applies the container's limits in the
        guest."""
        try:
            resources, wanted = parse_linux_resources(linux_resources)
        except ValueError as exc:
            raise Refused(f"update of {container_id}: {exc}") from None
        before = self.planner.sandbox if container_id == self.id else \
            self.planner.containers.get(container_id, ContainerResources())
        refused = None
        try:
            await self.apply(container_id, wanted)
        except StaticRefusal as exc:
            refused = exc
        try:
            await self._vm.agent().update(container_id, json.dumps(guestspec.resources(
                resources, self.guest_cpus(container_id))).encode())
        except BaseException:
            if refused is None:
                await self.apply(container_id, before, quiet=True)
            raise
        if refused is not None:
            raise refused

    async def update_totals(self, totals: ContainerResources, annotations: dict[str, str],
                            pod_cgroup_memory_mib: int | None) -> None:
        """The pod's own totals, annotations and pod cgroup changed (UpdateSandbox):
        re-planned and applied as one step, the inputs put back if it fails."""
        planner = self.planner
        before = (dict(planner.annotations), planner.pod_cgroup_memory_mib)
        planner.annotations.update(annotations)
        if pod_cgroup_memory_mib is not None:
            planner.pod_cgroup_memory_mib = pod_cgroup_memory_mib
        try:
            await self.apply(None, None, totals=totals)
        except BaseException:
            planner.annotations, planner.pod_cgroup_memory_mib = before
            raise

    def guest_cpus(self, container_id: str) -> list[int] | None:
        """The vCPUs a container's host cpuset maps to (pinned vCPUs), for its cpuset in
        the guest; None when it has no cpuset or nothing maps."""
        machine = self._vm.machine
        if machine is None:
            return None
        cpuset = self.planner.containers.get(container_id, ContainerResources()).cpuset
        if not cpuset:
            return None

        # Every vCPU when nothing maps (vCPUs floating): a cpuset set earlier in the guest
        # would otherwise stay, narrower than the container's CPUs now allow.
        return guest_cpus_for_update(parse_cpu_list(cpuset), machine.vcpu_pins) or None

    async def _confine(self, skip: str | None) -> None:
        """After the vCPUs were re-pinned: every other container's cpuset in the guest
        follows."""
        machine = self._vm.machine
        agent: Agent | None = machine.agent if machine is not None else None
        if agent is None:
            return
        for cid in sorted(self._containers.placed - {skip}):
            cpus = self.guest_cpus(cid)
            if cpus is None:
                continue
            try:
                await agent.update(cid, json.dumps(
                    {"cpu": {"cpus": guestspec.cpu_list(cpus)}}).encode())
            except TtrpcError as exc:
                log.warning("container %s: guest cpuset: %s", cid, exc.message)

    # --- CPUs -----------------------------------------------------------------------------

    def reserve_cpus(self) -> None:
        """cpu_reservation = "exclusive": the pod's own CPUs from the node-wide allocator
        (an integral CPU request), or the shared pool; the allocator kept until
        release_cpus(). AllocatorError (NoFreeCPUs, or state it cannot trust) as it is."""
        if self._config.runtime.cpu_reservation != "exclusive":
            return
        allocator = Allocator(reserved=self._config.runtime.reserved_cpus)
        count = self.planner.exclusive_request()
        if not count:
            self.planner.shared_pool = allocator.shared_pool
        else:
            self.planner.exclusive = allocator.reserve(self.id, count)
            log.info("sandbox %s: exclusive host CPUs %s", self.id,
                     sorted(self.planner.exclusive))
        self.allocator = allocator

    def release_cpus(self) -> None:
        """The CPUs reserve_cpus() took, given back to the node."""
        allocator, self.allocator = self.allocator, None
        if allocator is not None:
            allocator.release(self.id)

    async def watch_pool(self) -> None:
        """A pod in the shared pool follows it as exclusive reservations come and go,
        while its VM runs."""
        allocator = self.allocator
        assert allocator is not None
        seen = allocator.version()
        while self._vm.machine is not None:
            await asyncio.sleep(1)
            now = allocator.version()
            if now != seen:
                seen = now
                await self.apply(None, None, quiet=True)
