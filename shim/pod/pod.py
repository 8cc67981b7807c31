"""One pod, whichever API made it: its planning inputs and the plan in force, the VM and
the host state that goes with it (Sandbox: sandbox cgroup, shared directory, QEMU), the
exclusive CPUs it holds, and where its containers run in the guest. Every change is one
step: re-plan with the pure model, apply on the host, follow in the guest, commit, or
put back the plan in force. The VM's exit and OOM kills are told to listeners, so the
Pod never calls into an API service."""
from __future__ import annotations

import asyncio
import json
import logging
import signal
import time
from collections.abc import Mapping
from dataclasses import asdict
from typing import TYPE_CHECKING, Protocol

from podvm_core.cpulist import parse_cpu_list
from podvm_core.ttrpc import Code, TtrpcError

import cgroups

from .. import config
from ..api import errors
from ..vm import guestspec
from ..cpus.allocator import Allocator, AllocatorError
from ..cpus.pinning import guest_cpus_for_update
from ..host.cgroup import pod_cgroup_limits
from ..vm.hypervisor import HypervisorError
from ..network import remote
from ..resources import ContainerResources, PlanError, SandboxPlan, StaticSizeExceeded
from ..resources.model import from_linux_resources
from ..vm.sandbox import Sandbox, host
from .hostns import (HOST_NAMESPACES, host_namespaces_refusal, refuse_host_propagation,
                     spec_namespaces)
from .guestevents import oom_bucket, watch_oom
from .podfiles import with_mounts
from .sysctls import check_pod_sysctls
from .planner import PodPlanner, parse_linux_resources, planned, planning_error

if TYPE_CHECKING:
    from ..vm.agent import Agent
    from ..vm.stdio import Stdio

log = logging.getLogger("podvm.pod")


class StaticRefusal(Exception):
    """Growth a static-mode VM cannot take: refused, after what fits was applied.
    shim/api/errors.py answers it FAILED_PRECONDITION."""


class PodListener(Protocol):
    def vm_exited(self, error: HypervisorError) -> None:
        """The VM died under the pod (not stopped on purpose)."""

    def container_oom(self, container_id: str) -> None:
        """The guest's OOM killer killed a process of the container while it ran (a kill
        that ended its init comes with the init's exit instead)."""

    def vm_stopped(self) -> None:
        """The VM was stopped on purpose; what ran in it has ended."""


class Pod:
    def __init__(self, namespace: str, sandbox_id: str, cfg: config.Config,
                 planner: PodPlanner, cgroups_path: str = "", netns: str = "",
                 network_worker: remote.Worker | None = None) -> None:
        """`cgroups_path`: where the sandbox container's cgroup would be (either syntax);
        the sandbox cgroup goes under its parent, the pod cgroup. `netns`: the pod's
        network namespace as containerd made it (CNI's interfaces in it become the VM's);
        "" for a pod with a network of its own and no interface. `network_worker`: one
        started when the pod's request came (the pod's to use or close), so that it is
        ready when the boot needs it."""
        self.namespace = namespace
        self.netns = netns
        self.id = sandbox_id
        self.config = cfg
        self.planner = planner
        self.cgroups_path = cgroups_path
        self.created_plan = planned(planner.plan)
        """The plan the inputs gave before anything booted (refused here if it cannot)."""
        self.sandbox: Sandbox | None = None
        self.gone: HypervisorError | None = None
        """How the VM ended, when it died under the pod."""
        self.placed: set[str] = set()
        """Containers in the guest whose cpuset follows the vCPUs' pinning."""
        self.files: Mapping[str, str] = {}
        """Files every container gets at a path its spec does not mount ({path in the
        container: file on the host}): a Sandbox-API pod's /etc/hosts and the like."""
        self._listeners: list[PodListener] = []
        self._allocator = None
        self._applying = asyncio.Lock()
        self._death: asyncio.Future | None = None
        self._background: set[asyncio.Task] = set()
        self._network_worker = network_worker

    @classmethod
    def for_sandbox_container(cls, namespace: str, sandbox_id: str, cfg: config.Config,
                              spec: dict, network_worker: remote.Worker | None = None) -> Pod:
        """The pod of a sandbox container (the Task API), planned from its OCI spec and
        the pod cgroup kubelet made above its cgroupsPath."""
        linux = spec.get("linux") or {}
        cgroups_path = linux.get("cgroupsPath") or ""
        namespaces = spec_namespaces(spec)
        shared = [ns for ns in HOST_NAMESPACES if ns not in namespaces]  # none: the host's
        if shared:
            raise host_namespaces_refusal(shared)
        check_pod_sysctls(linux.get("sysctl") or {}, cfg)
        netns = namespaces["network"]
        memory_mib, cpus = pod_cgroup_limits(cgroups_path)
        planner = planned(lambda: PodPlanner.for_sandbox(cfg, spec, host(), memory_mib, cpus))
        return cls(namespace, sandbox_id, cfg, planner, cgroups_path, netns, network_worker)

    def listen(self, listener: PodListener) -> None:
        self._listeners.append(listener)

    @property
    def booted(self) -> bool:
        return self.sandbox is not None

    @property
    def plan(self) -> SandboxPlan:
        return self.sandbox.plan if self.sandbox is not None else self.created_plan

    @property
    def pid(self) -> int:
        return self.sandbox.pid if self.sandbox is not None else 0

    @property
    def agent(self) -> Agent:
        """The guest agent; the answer containerd gets when there is none."""
        if self.gone is not None:
            raise errors.to_ttrpc(self.gone)
        if self.sandbox is None or self.sandbox.agent is None:
            raise TtrpcError(Code.FAILED_PRECONDITION, "the pod's VM is not running")
        return self.sandbox.agent

    # --- life -------------------------------------------------------------------------

    async def boot(self) -> None:
        """Reserve the pod's CPUs (exclusive mode), plan, boot the VM, start watching it.
        Nothing is left behind when it fails."""
        # The worker is for one boot: a boot tried again starts its own.
        worker, self._network_worker = self._network_worker, None
        if worker is None and self.netns:
            worker = await remote.Worker.start()
        try:
            await self._boot(worker)
        finally:
            if worker is not None:
                await worker.close()

    async def _boot(self, worker: remote.Worker | None) -> None:
        allocator = self._reserve_cpus()
        try:
            self.planner.boot = planned(self.planner.plan)
            try:
                sandbox = Sandbox(self.namespace, self.id, self.config, self.planner.boot,
                                  self.cgroups_path, self.netns)
            except cgroups.CgroupError as exc:
                raise errors.to_ttrpc(exc, f"cgroup of sandbox {self.id}") from None
            for line in sandbox.plan.explanation:
                log.info("sandbox %s plan: %s", self.id, line)
            started = time.monotonic()
            try:
                await sandbox.boot(worker)
            except cgroups.CgroupError as exc:
                raise errors.to_ttrpc(exc, "sandbox cgroup") from None
            except HypervisorError as exc:
                raise errors.to_ttrpc(exc) from None
        except BaseException:
            if allocator is not None:
                allocator.release(self.id)
            raise
        log.info("sandbox %s: VM ready in %.2fs", self.id, time.monotonic() - started)
        self.sandbox, self._allocator = sandbox, allocator
        self._spawn(self._watch_vm(sandbox))
        self._spawn(self._watch_oom(sandbox))
        if self.planner.shared_pool is not None:
            self._spawn(self._watch_pool())

    async def stop(self, grace: float = 0) -> None:
        """Stop the VM and remove everything of the pod on the host; a no-op when
        stopped. `grace`: seconds the containers get to die of SIGKILL first, so that
        their exits are reported by the guest rather than assumed."""
        sandbox = self.sandbox
        if sandbox is None:
            await self._close_network_worker()
            return
        if sandbox.vm is not None and (sandbox.vm.dead() or (
                sandbox.agent is not None and sandbox.agent.lost)):
            # It died (or is dying: the agent's connection closes as QEMU exits) before
            # this stop, which containerd asks for once told the pod's processes ended:
            # say how, which the watcher would not, seeing the pod stopped.
            await self._died(sandbox)
        elif grace > 0 and sandbox.agent is not None and self.placed:
            await self._kill_all(sandbox.agent, grace)
        self.sandbox = None
        log.info("sandbox %s: stopping the VM", self.id)
        await sandbox.shutdown()
        if self._allocator is not None:
            self._allocator.release(self.id)
        for task in list(self._background):
            task.cancel()
        for listener in self._listeners:
            listener.vm_stopped()

    async def _close_network_worker(self) -> None:
        """End the worker started for a boot that will not come."""
        worker, self._network_worker = self._network_worker, None
        if worker is not None:
            await worker.close()

    async def _kill_all(self, agent: Agent, grace: float) -> None:
        containers = sorted(self.placed)  # it shrinks as their exits come in
        for container_id in containers:
            try:
                await agent.signal(container_id, "", signal.SIGKILL, True)
            except TtrpcError as exc:
                log.debug("sandbox %s: kill %s: %s", self.id, container_id, exc.message)
        waits = [asyncio.ensure_future(agent.wait(c, "")) for c in containers]
        _, pending = await asyncio.wait(waits, timeout=grace)
        for wait in waits:
            wait.cancel()
        await asyncio.gather(*waits, return_exceptions=True)
        if pending:
            log.warning("sandbox %s: %d container(s) still alive after %ss: stopping the VM "
                        "under them", self.id, len(pending), grace)

    # --- containers -------------------------------------------------------------------

    async def add_container(self, container_id: str, bundle: str, spec: dict,
                            rootfs: list, stdio: Stdio, *, holder: bool,
                            pod_holder: bool) -> None:
        """Re-plan with the container's resources (the sandbox container's are the
        pod's), share its files, create it in the guest. All or nothing.
        `holder`: the container whose Create booted the VM."""
        assert self.sandbox is not None
        refuse_host_propagation(container_id, spec)
        if not holder:
            resources = from_linux_resources((spec.get("linux") or {}).get("resources") or {})
            try:
                await self.apply(container_id, resources)
            except StaticRefusal:
                await self.apply(container_id, None, quiet=True)  # no container: none kept
                raise
        guest = guestspec.rewrite(with_mounts(spec, self.files), container_id,
                                  self.guest_cpus(container_id))
        for what in guest.dropped:
            log.info("container %s: left out %s", container_id, what)
        try:
            self.sandbox.share_container(container_id, bundle, rootfs, guest.binds)
            await self.agent.create_container(container_id, json.dumps(guest.spec).encode(),
                                              stdio, sandbox=holder, pod_holder=pod_holder)
        except BaseException as exc:
            await self._undo_add(container_id, holder)
            if isinstance(exc, OSError):
                raise TtrpcError(Code.INVALID_ARGUMENT,
                                 f"cannot share the files of container {container_id} with "
                                 f"its VM: {exc}") from None
            if isinstance(exc, ValueError):
                raise TtrpcError(Code.INVALID_ARGUMENT,
                                 f"container {container_id}: {exc}") from None
            raise
        self.placed.add(container_id)

    async def _undo_add(self, container_id: str, holder: bool) -> None:
        if self.sandbox is None:
            return
        try:
            self.sandbox.unshare_container(container_id)
        except OSError as exc:
            log.error("container %s: cleanup after a failed create: %s", container_id, exc)
        if holder:
            await self.stop()
        else:
            await self.apply(container_id, None, quiet=True)

    def container_stopped(self, container_id: str) -> None:
        """Its processes are gone: its guest cpuset no longer needs to follow."""
        self.placed.discard(container_id)

    async def remove_container(self, container_id: str, holder: bool) -> None:
        """Remove it from the guest and the host; the holder's removal stops the pod."""
        self.placed.discard(container_id)
        sandbox = self.sandbox
        if sandbox is None:
            return
        if sandbox.agent is not None:
            try:
                await sandbox.agent.remove(container_id)
            except TtrpcError as exc:
                log.warning("container %s: removal in the guest: %s", container_id,
                            exc.message)
        sandbox.unshare_container(container_id)
        if holder:
            await self.stop()
        else:
            await self.apply(container_id, None, quiet=True)

    # --- change -----------------------------------------------------------------------

    async def apply(self, container_id: str | None, resources: ContainerResources | None,
                    quiet: bool = False, totals: ContainerResources | None = None) -> None:
        """Re-plan with `container_id` at `resources` (None: gone; no id: the pod's own
        `totals`, or the shared CPU pool, changed) and apply the step: host cgroup limits,
        vCPUs and memory hot-plugged, vCPUs re-pinned, the guest's cpusets following.
        All or nothing: on failure the plan in force stays. Growth a static-mode VM
        cannot take is the exception: what fits (limits, cpuset) is applied, then
        StaticRefusal is raised. `quiet`: failures are logged only (cleanup)."""
        sandbox, planner = self.sandbox, self.planner
        if sandbox is None:
            return
        async with self._applying:
            containers, base = dict(planner.containers), totals
            if container_id is None:
                pass
            elif container_id == self.id:  # ctr run: the container is its own pod
                base = resources or ContainerResources()
            elif resources is None:
                containers.pop(container_id, None)
            else:
                containers[container_id] = resources
            refusal = None
            try:
                try:
                    delta = planner.update(sandbox.plan, containers, base)
                except StaticSizeExceeded as exc:
                    if exc.fitting is None:
                        raise
                    refusal, delta = exc, exc.fitting  # apply what fits, then refuse
                pins = list(sandbox.vcpu_pins)
                if delta.plan != sandbox.plan:
                    try:
                        await sandbox.resize(delta)
                    except (HypervisorError, cgroups.CgroupError) as exc:
                        raise errors.to_ttrpc(exc, f"resizing sandbox {self.id}") from None
            except (TtrpcError, PlanError) as exc:
                answer = exc if isinstance(exc, TtrpcError) else planning_error(exc)
                if not quiet:
                    raise answer from None
                log.warning("sandbox %s: re-plan without %s: %s", self.id, container_id,
                            answer.message)
                return
            planner.commit(containers, base)
            if pins != sandbox.vcpu_pins:
                await self._confine(skip=container_id)
            if refusal is not None:
                raise StaticRefusal(f"{refusal} (applied what fits in the VM: "
                                    f"{'; '.join(delta.notes)})")

    async def update_container(self, container_id: str, linux_resources: bytes) -> None:
        """Task.Update with OCI LinuxResources JSON: the host first (the guest gets room
        to grow), then the container's own limits in the guest; the host goes back if
        the guest refuses. A static refusal still applies the container's limits in the
        guest."""
        try:
            resources, wanted = parse_linux_resources(linux_resources)
        except ValueError as exc:
            raise TtrpcError(Code.INVALID_ARGUMENT,
                             f"update of {container_id}: {exc}") from None
        before = self.planner.sandbox if container_id == self.id else \
            self.planner.containers.get(container_id, ContainerResources())
        refused = None
        try:
            await self.apply(container_id, wanted)
        except StaticRefusal as exc:
            refused = exc
        try:
            await self.agent.update(container_id, json.dumps(guestspec.resources(
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
        if self.sandbox is None:
            return None
        cpuset = self.planner.containers.get(container_id, ContainerResources()).cpuset
        if not cpuset:
            return None

        # Every vCPU when nothing maps (vCPUs floating): a cpuset set earlier in the guest
        # would otherwise stay, narrower than the container's CPUs now allow.
        return guest_cpus_for_update(parse_cpu_list(cpuset), self.sandbox.vcpu_pins) or None

    async def _confine(self, skip: str | None) -> None:
        """After the vCPUs were re-pinned: every other container's cpuset in the guest
        follows."""
        if self.sandbox is None or self.sandbox.agent is None:
            return
        for cid in sorted(self.placed - {skip}):
            cpus = self.guest_cpus(cid)
            if cpus is None:
                continue
            try:
                await self.sandbox.agent.update(cid, json.dumps(
                    {"cpu": {"cpus": guestspec.cpu_list(cpus)}}).encode())
            except TtrpcError as exc:
                log.warning("container %s: guest cpuset: %s", cid, exc.message)

    # --- CPUs -------------------------------------------------------------------------

    def _reserve_cpus(self):
        """cpu_reservation = "exclusive": the pod's own CPUs from the node-wide allocator
        (an integral CPU request), or the shared pool. The allocator, or None."""
        if self.config.runtime.cpu_reservation != "exclusive":
            return None
        allocator = Allocator(reserved=self.config.runtime.reserved_cpus)
        count = self.planner.exclusive_request()
        if not count:
            self.planner.shared_pool = allocator.shared_pool
            return allocator
        try:
            self.planner.exclusive = allocator.reserve(self.id, count)
        except AllocatorError as exc:  # NoFreeCPUs, or state it cannot trust
            raise errors.to_ttrpc(exc) from None
        log.info("sandbox %s: exclusive host CPUs %s", self.id, sorted(self.planner.exclusive))
        return allocator

    async def _watch_pool(self) -> None:
        """A pod in the shared pool follows it as exclusive reservations come and go."""
        assert self._allocator is not None
        seen = self._allocator.version()
        while self.sandbox is not None:
            await asyncio.sleep(1)
            now = self._allocator.version()
            if now != seen:
                seen = now
                await self.apply(None, None, quiet=True)

    # --- watching ---------------------------------------------------------------------

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _watch_vm(self, sandbox: Sandbox) -> None:
        assert sandbox.vm is not None
        await sandbox.vm.wait()
        if self.sandbox is sandbox:  # else stopped on purpose
            await self._died(sandbox)

    async def _died(self, sandbox: Sandbox) -> None:
        """The VM ended under the pod: the listeners hear how, once (the watcher and a
        stop that finds the VM dead may both get here)."""
        assert sandbox.vm is not None
        if self._death is None:
            self._death = asyncio.ensure_future(self._tell_death(sandbox))
        # Shielded: stop() cancels the watcher, and the listeners must still hear it.
        await asyncio.shield(self._death)

    async def _tell_death(self, sandbox: Sandbox) -> None:
        assert sandbox.vm is not None
        self.gone = await sandbox.vm.exited(grace=5) or HypervisorError(
            "the guest agent's connection closed, QEMU still running")
        log.error("sandbox %s: %s", self.id, self.gone)
        for listener in self._listeners:
            listener.vm_exited(self.gone)

    async def _watch_oom(self, sandbox: Sandbox) -> None:
        """Paced by the pod's own bucket (shim/pod/guestevents.py)."""
        if sandbox.agent is not None:
            await watch_oom(sandbox.agent, self.id, oom_bucket(), self._tell_oom)

    def _tell_oom(self, container_id: str) -> None:
        for listener in self._listeners:
            listener.container_oom(container_id)

    # --- looking ---------------------------------------------------------------------

    async def status(self) -> dict[str, str]:
        """The plan in force, and what QEMU and the guest say now (JSON values), for
        SandboxStatus(verbose)."""
        info = {"plan": json.dumps(asdict(self.plan))}
        sandbox = self.sandbox
        if sandbox is None or sandbox.vm is None:
            return info
        try:
            vcpus, memory = await sandbox.vm.size()
        except HypervisorError as exc:  # QEMU going away under us: status still answers
            log.debug("sandbox %s: VM size: %s", self.id, exc)
        else:
            info["vm"] = json.dumps({"vcpus": vcpus, "memory_mib": memory})
        if sandbox.agent is not None:
            try:
                guest = await sandbox.agent.ping(timeout=5)
            except TtrpcError as exc:
                log.debug("sandbox %s: guest size: %s", self.id, exc.message)
            else:
                info["guest"] = json.dumps({"online_cpus": guest.online_cpus,
                                            "memory_total_mib": guest.memory_total_bytes >> 20})
        return info

    def metrics(self):
        """The sandbox cgroup's metrics (an Any), for SandboxMetrics."""
        if self.sandbox is None:
            raise TtrpcError(Code.FAILED_PRECONDITION, f"sandbox {self.id} is not running")
        return self.sandbox.cgroup.metrics()

