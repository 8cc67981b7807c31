"""One pod, whichever API made it: the Machine it owns while the VM runs (shim/vm/machine.py),
held in its VMSlot (shim/pod/vmslot.py) for its parts to find; its Resizer, each change of
the plan one step (shim/pod/resize.py); its Containers, the table of what runs in the guest
(shim/pod/containers.py). The Pod decides the plan around each container it adds or
removes. The VM's exit and OOM kills are told to listeners, so the Pod never calls into an
API service; what it refuses or cannot do it raises as typed errors (shim/pod/errors.py)."""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Mapping
from dataclasses import asdict
from typing import TYPE_CHECKING, Protocol

from podvm_core.ttrpc import Code, TtrpcError

import cgroups

from .. import config
from ..host import paths
from ..host.capacity import capacity
from ..network.ahead import WorkerAhead
from ..resources import SandboxPlan
from ..resources.model import from_linux_resources
from ..resources.planner import PodPlanner, planned
from ..vm.agent import RUNC
from ..vm.hypervisor import HypervisorError, VMKilled
from ..vm.machine import Machine
from .containers import Containers
from .errors import NotRunning, PodFilesError, Refused, StaticRefusal, StepFailed
from .guestevents import oom_bucket, watch_oom
from .hostns import refuse_host_namespaces, refuse_host_propagation
from .podfiles import with_mounts
from .exitstatus import KILLED_STATUS, VM_GONE_STATUS
from .request import PodRequest
from .resize import Resizer
from .sysctls import check_pod_sysctls
from .vmslot import VMSlot

if TYPE_CHECKING:
    from ..host.mounts import Mount
    from ..vm.stdio import Stdio

log = logging.getLogger("podvm.pod")


class PodListener(Protocol):
    def vm_exited(self, error: HypervisorError, status: int) -> None:
        """The VM died under the pod, or was killed for not answering (not stopped on
        purpose): each process still running in it ended with `status`."""

    def container_oom(self, container_id: str) -> None:
        """The guest's OOM killer killed a process of the container while it ran (a kill
        that ended its init comes with the init's exit instead)."""

    def vm_stopped(self) -> None:
        """The VM was stopped on purpose; what ran in it has ended."""


class Pod:
    def __init__(self, request: PodRequest, cfg: config.Config, planner: PodPlanner,
                 network_worker: WorkerAhead | None = None) -> None:
        """Use Pod.create: it checks the request and plans first."""
        self.namespace = request.namespace
        self.id = request.id
        self.netns = request.netns
        self.network_worker = network_worker or WorkerAhead()
        """The worker that attaches the pod's network as it boots: its PodSlot's, which
        may have started it ahead (shim/network/ahead.py), else one of the pod's own."""
        self.cgroups_path = request.cgroups_path
        self.pod_name = (request.pod_name, request.pod_namespace)
        self.log_directory = request.log_directory
        self.config = cfg
        self.created_plan = planned(planner.plan)
        """The plan the inputs gave before anything booted (refused here if it cannot)."""
        self.vm = VMSlot()
        """The Machine while the VM runs, where the parts below find it."""
        self.containers = Containers(self.id, self.vm, cfg)
        self.resizer = Resizer(self.id, cfg, planner, self.vm, self.containers)
        """The planner, the CPUs held and every change of the plan."""
        self.files: Mapping[str, str] = {}
        """Files every container gets at a path its spec does not mount ({path in the
        container: file on the host}): a Sandbox-API pod's /etc/hosts and the like."""
        self.hostname = ""
        """A Sandbox-API pod's hostname, for the guest process that holds its namespaces."""
        self.sysctls = dict(request.sysctls)
        self._listeners: list[PodListener] = []
        self._death: asyncio.Future | None = None
        self._background: set[asyncio.Task] = set()
        self._signals: set[asyncio.Task] = set()
        """Signals under way: each one carried on (and escalated) when containerd gives
        up on its Kill."""

    @classmethod
    def create(cls, request: PodRequest, cfg: config.Config,
               network_worker: WorkerAhead | None = None) -> Pod:
        """The pod either API asked for: the host's namespaces and VM-wide sysctls
        refused, its /etc files read, planned (refused if it cannot be), its files
        written; nothing boots yet. `network_worker`: its PodSlot's (see
        Pod.network_worker)."""
        refuse_host_namespaces(request.host_namespaces)
        check_pod_sysctls(request.sysctls, cfg)
        files = None
        if request.files is not None:
            try:
                files = request.files()
            except OSError as exc:
                raise PodFilesError(f"the pod has no DNS configuration and the host's cannot "
                                    f"be read: {exc}") from None
        planner = planned(lambda: request.planner(cfg, capacity()))
        pod = cls(request, cfg, planner, network_worker)
        if files is not None:
            try:
                pod.files = files.write(paths.state_dir(request.namespace, request.id))
            except OSError as exc:
                raise PodFilesError(f"cannot write the pod's /etc files: {exc}") from None
            pod.hostname = files.hostname
        return pod

    def listen(self, listener: PodListener) -> None:
        self._listeners.append(listener)

    @property
    def booted(self) -> bool:
        return self.vm.machine is not None

    @property
    def plan(self) -> SandboxPlan:
        machine = self.vm.machine
        return machine.plan if machine is not None else self.created_plan

    @property
    def pid(self) -> int:
        machine = self.vm.machine
        return machine.pid if machine is not None else 0

    # --- life -------------------------------------------------------------------------

    async def boot(self) -> None:
        """Reserve the pod's CPUs (exclusive mode), plan, boot the VM, start watching it.
        Nothing is left behind when it fails. The network worker, when no one started it
        ahead, starts first, and ends with the boot."""
        if self.netns:
            await self.network_worker.start()
        try:
            await self._boot()
        finally:
            await self.network_worker.close()

    async def _boot(self) -> None:
        planner = self.resizer.planner
        self.resizer.reserve_cpus()
        try:
            planner.boot = planned(planner.plan)
            try:
                machine = Machine(self.namespace, self.id, self.config, planner.boot,
                                  self.cgroups_path, self.netns, self.pod_name,
                                  self.network_worker, self.log_directory)
            except cgroups.CgroupError as exc:
                raise StepFailed(f"cgroup of sandbox {self.id}", exc) from None
            for line in machine.plan.explanation:
                log.info("sandbox %s plan: %s", self.id, line)
            started = time.monotonic()
            try:
                await machine.boot()
            except cgroups.CgroupError as exc:
                raise StepFailed("sandbox cgroup", exc) from None
        except BaseException:
            self.resizer.release_cpus()
            raise
        self.vm.machine = machine
        log.info("sandbox %s: VM ready in %.2fs, of which the guest %.2fs", self.id,
                 time.monotonic() - started, self.vm.guest_seconds())
        self._spawn(self._watch_vm(machine))
        self._spawn(self._watch_stop(machine))
        self._spawn(machine.time_agent())
        machine.make_template()
        self._spawn(self._watch_oom(machine))
        if planner.shared_pool is not None:
            self._spawn(self.resizer.watch_pool())

    async def stop(self, grace: float = 0) -> None:
        """Stop the VM and remove everything of the pod on the host; a no-op when
        stopped. `grace`: seconds the containers get to die of SIGKILL first, so that
        their exits are reported by the guest rather than assumed."""
        machine = self.vm.machine
        if machine is None:
            return
        if machine.ended():
            # It died (or is dying: the agent's connection closes as QEMU exits) before
            # this stop, which containerd asks for once told the pod's processes ended:
            # say how, which the watcher would not, seeing the pod stopped.
            await self._died(machine)
        elif grace > 0 and machine.agent is not None and self.containers.placed:
            await self.containers.kill_all(machine.agent, grace)
        await self.containers.drop_removals()
        self.vm.machine = None
        log.info("sandbox %s: stopping the VM", self.id)
        await machine.shutdown()
        self.resizer.release_cpus()
        for task in list(self._background):
            task.cancel()
        self.containers.placed.clear()  # what ran in the VM has ended
        for listener in self._listeners:
            listener.vm_stopped()

    # --- containers ---------------------------------------------------------------------

    async def add_container(self, container_id: str, bundle: str, spec: dict,
                            rootfs: list[Mount], stdio: Stdio, *, owns_vm: bool,
                            pod_holder: bool) -> None:
        """Re-plan with the container's resources (the sandbox container's are the
        pod's), share its files, create it in the guest. All or nothing. `owns_vm`: the
        container whose Create booted the VM; `pod_holder`: the container holds the
        pod's namespaces in the guest (a CRI sandbox container)."""
        await self.containers.removed()  # the ones containerd deleted count no more
        assert self.vm.machine is not None
        refuse_host_propagation(container_id, spec)
        if not owns_vm:
            resources = from_linux_resources((spec.get("linux") or {}).get("resources") or {})
            try:
                await self.resizer.apply(container_id, resources)
            except StaticRefusal:
                await self.resizer.apply(container_id, None, quiet=True)  # none kept
                raise
        try:
            guest = self.containers.guest_spec(
                container_id, with_mounts(spec, self.files),
                self.resizer.guest_cpus(container_id), pod_holder=pod_holder)
        except (OSError, ValueError) as exc:
            if not owns_vm:
                await self.resizer.apply(container_id, None, quiet=True)
            raise Refused(f"container {container_id}: {exc}") from None
        try:
            await self.containers.create(container_id, bundle, rootfs, guest, stdio,
                                         owns_vm=owns_vm, pod_holder=pod_holder)
        except BaseException:
            await self._let_go(container_id, owns_vm)
            raise

    async def remove_container(self, container_id: str, owns_vm: bool) -> None:
        """Remove it from the host and the guest, a workload container's guest part after
        the caller has answered (Containers.remove_later); removing the container that
        booted the VM stops the pod."""
        if not owns_vm:
            return self.containers.remove_later(
                container_id, lambda: self.resizer.apply(container_id, None, quiet=True))
        await self.containers.remove(container_id)
        await self.stop()

    async def _let_go(self, container_id: str, owns_vm: bool) -> None:
        """A container gone, or not added after all: the pod stopped if it booted the
        VM, else re-planned without it."""
        if owns_vm:
            await self.stop()
        else:
            await self.resizer.apply(container_id, None, quiet=True)

    # --- watching ---------------------------------------------------------------------

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _watch_vm(self, machine: Machine) -> None:
        await machine.wait()
        if self.vm.machine is machine:  # else stopped on purpose
            await self._died(machine)

    async def _died(self, machine: Machine) -> None:
        """The VM ended under the pod: the listeners hear how, once (the watcher and a
        stop that finds the VM dead may both get here)."""
        if self._death is None:
            self._death = asyncio.ensure_future(self._tell_death(machine))
        # Shielded: stop() cancels the watcher, and the listeners must still hear it.
        await asyncio.shield(self._death)

    async def _tell_death(self, machine: Machine) -> None:
        gone = await machine.exited(grace=5) or HypervisorError(
            "the guest agent's connection closed, QEMU still running")
        log.error("sandbox %s: %s", self.id, gone)
        self._tell(gone, VM_GONE_STATUS)

    def _tell(self, gone: HypervisorError, status: int) -> None:
        self.vm.gone = gone
        self.containers.placed.clear()  # what ran in the VM has ended
        for listener in self._listeners:
            listener.vm_exited(gone, status)

    # --- a VM that stops answering ------------------------------------------------------

    async def signal(self, container_id: str, exec_id: str, signal: int, all_: bool) -> None:
        """A signal to a process in the guest. A guest that does not answer it within
        its deadline (shim/vm/agent.py, RUNC) has stopped answering (its VM paused, its
        kernel hung, its agent stopped): its VM is killed (kill_vm) and the signal is
        done, so that such a VM never holds its pod's stop. Carried on in a task of the
        pod's: containerd giving up on its Kill first does not call the escalation off."""
        task = asyncio.ensure_future(self._signal(container_id, exec_id, signal, all_))
        self._signals.add(task)
        task.add_done_callback(_retrieved)
        task.add_done_callback(self._signals.discard)
        await asyncio.shield(task)

    async def _signal(self, container_id: str, exec_id: str, signal: int, all_: bool) -> None:
        machine = self.vm.machine
        try:
            await self.containers.signal(container_id, exec_id, signal, all_)
        except TtrpcError as exc:
            if exc.code != Code.DEADLINE_EXCEEDED or machine is None:
                raise
            await self.kill_vm(machine, f"the guest did not answer signal {signal} to "
                                        f"{exec_id or container_id} within {RUNC:g}s")

    async def _watch_stop(self, machine: Machine) -> None:
        """QEMU stopping the VM without the shim asking (shim/vm/qemu/monitor.py) ends it:
        an I/O error or an internal one comes back at the next try, a panicked guest
        never resumes, and a pod whose VM is stopped runs nothing while kubelet counts
        its containers as running (docs/design.md, "A VM that stops answering")."""
        try:
            state = await machine.unasked_stop()
        except HypervisorError:
            return  # gone: the exit's watcher says how
        await self.kill_vm(machine, f"QEMU stopped the VM unasked (run state {state})")

    async def kill_vm(self, machine: Machine, reason: str, asked: bool = False) -> None:
        """End a VM that stopped answering or running, or whose sandbox was killed (`asked`):
        every process in it reported exited 137, as runc reports a process killed by
        SIGKILL, then QEMU killed. The pod's stop removes the rest, as after any death."""
        if self.vm.machine is not machine or self._death is not None:
            return
        (log.info if asked else log.error)(
            "sandbox %s: %s: killing its VM, every container exits 137", self.id, reason)
        self._death = asyncio.get_running_loop().create_future()
        self._death.set_result(None)
        self._tell(VMKilled(f"the VM of sandbox {self.id} was killed: {reason}"),
                   KILLED_STATUS)
        machine.kill()

    async def _watch_oom(self, machine: Machine) -> None:
        """Paced by the pod's own bucket (shim/pod/guestevents.py)."""
        if machine.agent is not None:
            await watch_oom(machine.agent, self.id, oom_bucket(), self._tell_oom)

    def _tell_oom(self, container_id: str) -> None:
        for listener in self._listeners:
            listener.container_oom(container_id)
        machine = self.vm.machine
        if machine is not None:  # counted for the node's metrics (podvm_node/collect.py)
            machine.record(guest_oom_kills=machine.state.guest_oom_kills + 1)

    # --- looking ---------------------------------------------------------------------

    async def status(self) -> dict[str, str]:
        """The plan in force, and what QEMU and the guest say now (JSON values), for
        SandboxStatus(verbose)."""
        info = {"plan": json.dumps(asdict(self.plan))}
        machine = self.vm.machine
        if machine is None:
            return info
        try:
            size = await machine.size()
        except HypervisorError as exc:  # QEMU going away under us: status still answers
            log.debug("sandbox %s: VM size: %s", self.id, exc)
        else:
            if size is None:
                return info
            info["vm"] = json.dumps({"vcpus": size[0], "memory_mib": size[1]})
        if machine.agent is not None:
            try:
                guest = await machine.agent.ping(timeout=5)
            except TtrpcError as exc:
                log.debug("sandbox %s: guest size: %s", self.id, exc.message)
            else:
                info["guest"] = json.dumps({"online_cpus": guest.online_cpus,
                                            "memory_total_mib": guest.memory_total_bytes >> 20})
        return info

    def metrics(self):
        """The sandbox cgroup's metrics (an Any), for SandboxMetrics."""
        if self.vm.machine is None:
            raise NotRunning(f"sandbox {self.id} is not running")
        return self.vm.machine.metrics()

    # --- the pod's own namespaces (Sandbox API) -------------------------------------------

    async def hold_namespaces(self) -> int:
        """A guest process holds the pod's namespaces, hostname and sysctls: its pid."""
        return await self.vm.agent().create_pod_namespaces(self.hostname, self.sysctls)

    async def ping(self, timeout: float) -> None:
        await self.vm.agent().ping(timeout=timeout)


def _retrieved(task: asyncio.Task) -> None:
    """Its failure was the Kill's to answer: nothing to log when no one waited for it."""
    if not task.cancelled():
        task.exception()
