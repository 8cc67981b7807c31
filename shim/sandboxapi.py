"""containerd.runtime.sandbox.v1.Sandbox: containerd 2.x's "shim" sandboxer hands the
pod sandbox itself to the shim, with the whole PodSandboxConfig (resources, overhead,
cgroup parent) before anything boots. No pause container: the VM is the sandbox, and a
process in the guest holds the pod's namespaces. Containers then come through the Task
API of the same shim. Protocol: protocol.md section 4.

States: (none) -CreateSandbox-> created -StartSandbox-> ready -StopSandbox/VM exit->
stopped; ShutdownSandbox ends the shim from any of them."""
from __future__ import annotations

import asyncio
import enum
import json
import logging
import signal
import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Callable

from .pb.containerd.runtime.sandbox.v1 import sandbox_pb2 as api
from .ttrpc import Code, Context, TtrpcError

if TYPE_CHECKING:
    from .config import Config
    from .podplan import PodPlanner
    from .resources import ContainerResources, SandboxPlan
    from .task.service import TaskService

log = logging.getLogger("podvm.sandboxapi")

POD_SANDBOX_CONFIG = "runtime.v1.PodSandboxConfig"
LINUX_RESOURCES = "LinuxResources"
READY, NOT_READY = "SANDBOX_READY", "SANDBOX_NOTREADY"
MIB = 1 << 20
STOP_TIMEOUT = 10
"""Seconds StopSandbox gives the pod's processes to die when the request sets none."""
KILLED_STATUS = 128 + signal.SIGKILL


class Phase(enum.Enum):
    CREATED = "created"
    READY = "ready"
    STOPPED = "stopped"


class SandboxService:
    def __init__(self, tasks: TaskService, shutdown: Callable[[], None]) -> None:
        self.tasks = tasks
        self._shutdown = shutdown
        self.id = ""
        self.phase: Phase | None = None
        self._config: Config | None = None
        self._planner: PodPlanner | None = None
        self._cgroups_path = ""
        self._created_at_ns = 0
        self._exited_at_ns = 0
        self._exit_status = 0
        self._exited = asyncio.Event()
        self._overhead_bytes = 0
        self._created_plan: SandboxPlan | None = None
        """The plan CreateSandbox validated, shown until the VM runs."""
        self._transition = asyncio.Lock()
        """One Start, Stop or Shutdown at a time: a second waits, then sees the phase."""

    # --- state ------------------------------------------------------------------------

    def _check(self, sandbox_id: str, *phases: Phase) -> None:
        if not sandbox_id:
            raise TtrpcError(Code.INVALID_ARGUMENT, "the sandbox id is empty")
        if self.phase is None or sandbox_id != self.id:
            raise TtrpcError(Code.NOT_FOUND, f"sandbox {sandbox_id!r} not found"
                             + (f" (this shim serves {self.id!r})" if self.id else ""))
        if phases and self.phase not in phases:
            wanted = " or ".join(p.value for p in phases)
            raise TtrpcError(Code.FAILED_PRECONDITION,
                             f"sandbox {sandbox_id} is {self.phase.value}, not {wanted}")

    def vm_gone(self, status: int, at_ns: int) -> None:
        """The VM exited on its own (the Task service saw QEMU go)."""
        if self.phase is Phase.READY:
            self._stopped(status, at_ns)

    def _stopped(self, status: int, at_ns: int) -> None:
        self.phase = Phase.STOPPED
        self._exit_status, self._exited_at_ns = status, at_ns
        self._exited.set()

    # --- RPCs -------------------------------------------------------------------------

    async def CreateSandbox(self, req: api.CreateSandboxRequest,
                            ctx: Context) -> api.CreateSandboxResponse:
        """Validate and plan from the PodSandboxConfig; nothing boots yet."""
        if not req.sandbox_id:
            raise TtrpcError(Code.INVALID_ARGUMENT, "create: the sandbox id is empty")
        if self.phase is not None:
            raise TtrpcError(Code.ALREADY_EXISTS, f"sandbox {self.id!r} already exists in "
                                                  f"this shim")
        if self.tasks.sandbox is not None:
            raise TtrpcError(Code.ALREADY_EXISTS, f"this shim already runs the pod of "
                                                  f"container {self.tasks.sandbox.id!r}")
        from . import config
        from .podplan import PodPlanner
        from .resources import ContainerResources
        from .sandbox import host
        from .task.service import _planned

        try:
            cfg = config.load()
        except config.ConfigError as exc:
            raise TtrpcError(Code.INVALID_ARGUMENT, f"podvm configuration: {exc}") from None
        pod = _pod_config(req.options)
        linux = pod.linux if pod is not None else None
        overhead = linux.overhead if linux is not None else None
        base = _pod_resources(pod) if pod is not None else ContainerResources()
        annotations = dict(pod.annotations) if pod is not None else {}
        annotations.update(req.annotations)
        overhead_bytes = max(0, overhead.memory_limit_in_bytes) if overhead is not None else 0
        # kubelet's pod cgroup: the containers' limits plus the RuntimeClass overhead
        pod_memory_mib = -(-(base.memory_limit + overhead_bytes) // MIB) \
            if base.memory_limit else 0  # rounded up, as pod_cgroup_limits does
        cgroup_parent = linux.cgroup_parent if linux is not None else ""
        planner = _planned(lambda: PodPlanner(cfg, annotations, base, host(), pod_memory_mib))
        plan = _planned(planner.plan)  # refused here, before anything boots
        for line in plan.explanation:
            log.info("sandbox %s plan: %s", req.sandbox_id, line)
        self.id, self.phase = req.sandbox_id, Phase.CREATED
        self._config, self._planner, self._created_plan = cfg, planner, plan
        self._overhead_bytes = overhead_bytes
        self._cgroups_path = _cgroups_path(cgroup_parent, req.sandbox_id)
        self.tasks.pod_owner = self
        return api.CreateSandboxResponse()

    async def StartSandbox(self, req: api.StartSandboxRequest,
                           ctx: Context) -> api.StartSandboxResponse:
        if self.phase is None and req.sandbox_id:
            raise TtrpcError(Code.FAILED_PRECONDITION if not self.id else Code.NOT_FOUND,
                             f"sandbox {req.sandbox_id!r} was not created: CreateSandbox first")
        async with self._transition:
            self._check(req.sandbox_id, Phase.CREATED)
            return await self._start()

    async def _start(self) -> api.StartSandboxResponse:
        assert self._config is not None and self._planner is not None
        await self.tasks.start_pod(self.id, self._config, self._planner, self._cgroups_path)
        sandbox = self.tasks.sandbox
        assert sandbox is not None and sandbox.agent is not None
        try:
            holder = await sandbox.agent.create_pod_namespaces()
        except BaseException:
            await self.tasks.stop_pod()
            raise
        log.info("sandbox %s: ready, QEMU %d, pod namespaces held by guest pid %d", self.id,
                 sandbox.pid, holder)
        self.phase, self._created_at_ns = Phase.READY, time.time_ns()
        response = api.StartSandboxResponse(pid=sandbox.pid)
        response.created_at.FromNanoseconds(self._created_at_ns)
        return response

    async def Platform(self, req: api.PlatformRequest, ctx: Context) -> api.PlatformResponse:
        self._check(req.sandbox_id)
        response = api.PlatformResponse()
        response.platform.os, response.platform.architecture = "linux", "amd64"
        return response

    async def StopSandbox(self, req: api.StopSandboxRequest,
                          ctx: Context) -> api.StopSandboxResponse:
        """The pod's processes get `timeout_secs` to die (SIGKILL), then the VM stops;
        a process still alive then is reported killed."""
        self._check(req.sandbox_id)
        async with self._transition:
            if self.phase is Phase.READY:
                await self._stop(req.timeout_secs or STOP_TIMEOUT)
            elif self.phase is Phase.CREATED:
                self._stopped(0, time.time_ns())
            else:
                await self.tasks.stop_pod()  # the VM died on its own: what is left on the host
        return api.StopSandboxResponse()

    async def _stop(self, timeout: float) -> None:
        from .task.process import State

        processes = [p for c in self.tasks.containers.values()
                     for p in (c.init, *c.execs.values())]
        live = [p for p in processes if p.state in (State.CREATED, State.RUNNING, State.PAUSED)]
        sandbox = self.tasks.sandbox
        if live and sandbox is not None and sandbox.agent is not None:
            for container_id in {p.container_id for p in live}:
                try:
                    await sandbox.agent.signal(container_id, "", signal.SIGKILL, True)
                except TtrpcError as exc:
                    log.debug("sandbox %s: kill %s: %s", self.id, container_id, exc.message)
            # Started processes are reaped and report their own exit; created ones
            # (runc's init waiting for Start) end with the VM.
            waits = [asyncio.ensure_future(p.wait()) for p in live
                     if p.state is not State.CREATED]
            if waits:
                _, pending = await asyncio.wait(waits, timeout=timeout)
                for wait in pending:
                    wait.cancel()
                if pending:
                    log.warning("sandbox %s: %d process(es) still alive after %ss: stopping "
                                "the VM under them", self.id, len(pending), timeout)
        await self.tasks.stop_pod()
        self.tasks.end_processes(KILLED_STATUS)
        self._stopped(0, time.time_ns())

    async def WaitSandbox(self, req: api.WaitSandboxRequest,
                          ctx: Context) -> api.WaitSandboxResponse:
        self._check(req.sandbox_id)
        await self._exited.wait()
        response = api.WaitSandboxResponse(exit_status=self._exit_status)
        response.exited_at.FromNanoseconds(self._exited_at_ns)
        return response

    async def SandboxStatus(self, req: api.SandboxStatusRequest,
                            ctx: Context) -> api.SandboxStatusResponse:
        self._check(req.sandbox_id)
        sandbox = self.tasks.sandbox
        ready = self.phase is Phase.READY and sandbox is not None
        response = api.SandboxStatusResponse(sandbox_id=self.id,
                                             pid=sandbox.pid if ready else 0,
                                             state=READY if ready else NOT_READY)
        if self._created_at_ns:
            response.created_at.FromNanoseconds(self._created_at_ns)
        if self._exited_at_ns:
            response.exited_at.FromNanoseconds(self._exited_at_ns)
        if req.verbose:
            plan = sandbox.plan if ready else self._created_plan
            if plan is not None:
                response.info["plan"] = json.dumps(asdict(plan))
            response.info["phase"] = self.phase.value if self.phase else ""
            if ready:
                try:
                    vcpus, memory = await sandbox.vm.size()
                except Exception as exc:  # QEMU going away under us: status still answers
                    log.debug("sandbox %s: VM size: %s", self.id, exc)
                else:
                    response.info["vm"] = json.dumps({"vcpus": vcpus, "memory_mib": memory})
                if sandbox.agent is not None:
                    try:
                        guest = await sandbox.agent.ping(timeout=5)
                    except TtrpcError as exc:
                        log.debug("sandbox %s: guest size: %s", self.id, exc.message)
                    else:
                        response.info["guest"] = json.dumps({
                            "online_cpus": guest.online_cpus,
                            "memory_total_mib": guest.memory_total_bytes >> 20})
        return response

    async def PingSandbox(self, req: api.PingRequest, ctx: Context) -> api.PingResponse:
        self._check(req.sandbox_id, Phase.READY)
        sandbox = self.tasks.sandbox
        if sandbox is None or sandbox.agent is None:
            raise TtrpcError(Code.UNAVAILABLE, f"sandbox {self.id}: the VM is not running")
        await sandbox.agent.ping(timeout=10)
        return api.PingResponse()

    async def ShutdownSandbox(self, req: api.ShutdownSandboxRequest,
                              ctx: Context) -> api.ShutdownSandboxResponse:
        self._check(req.sandbox_id)
        async with self._transition:
            if self.phase is Phase.READY:
                await self._stop(STOP_TIMEOUT)
            elif self.phase is Phase.CREATED:
                self._stopped(0, time.time_ns())
        log.info("sandbox %s: shutdown", self.id)
        self._shutdown()
        return api.ShutdownSandboxResponse()

    async def SandboxMetrics(self, req: api.SandboxMetricsRequest,
                             ctx: Context) -> api.SandboxMetricsResponse:
        self._check(req.sandbox_id, Phase.READY)
        sandbox = self.tasks.sandbox
        assert sandbox is not None
        response = api.SandboxMetricsResponse()
        response.metrics.id = self.id
        response.metrics.timestamp.FromNanoseconds(time.time_ns())
        response.metrics.data.CopyFrom(sandbox.cgroup.metrics())
        return response

    async def UpdateSandbox(self, req: api.UpdateSandboxRequest,
                            ctx: Context) -> api.UpdateSandboxResponse:
        """New pod totals (LinuxResources JSON or a PodSandboxConfig) and annotations:
        re-planned and applied through the same path as Task.Update, all or nothing."""
        self._check(req.sandbox_id, Phase.READY)
        planner = self._planner
        assert planner is not None
        wanted, overhead, annotations = self._update_inputs(req)
        annotations.update(req.annotations)
        before = (dict(planner.annotations), planner.pod_cgroup_memory_mib,
                  self._overhead_bytes)
        planner.annotations.update(annotations)
        if overhead is not None:
            self._overhead_bytes = overhead
        if planner.pod_cgroup_memory_mib or wanted.memory_limit:
            # kubelet resizes the pod cgroup with the pod: its limits plus the overhead
            planner.pod_cgroup_memory_mib = (wanted.memory_limit + self._overhead_bytes) \
                // MIB if wanted.memory_limit else 0
        try:
            await self.tasks.update_pod(wanted)  # annotations are in the planner already
        except BaseException:
            planner.annotations, planner.pod_cgroup_memory_mib, self._overhead_bytes = before
            raise
        log.info("sandbox %s: updated to %s", self.id, wanted)
        return api.UpdateSandboxResponse()

    def _update_inputs(self, req: api.UpdateSandboxRequest
                       ) -> tuple[ContainerResources, int | None, dict[str, str]]:
        """(the pod's new totals, its new overhead in bytes or None, annotations)."""
        from .podplan import parse_linux_resources

        assert self._planner is not None
        url = req.resources.type_url
        if not url:
            if not req.annotations:
                raise TtrpcError(Code.INVALID_ARGUMENT, f"update of sandbox {self.id}: "
                                                        f"neither resources nor annotations")
            return self._planner.sandbox, None, {}
        if url.endswith(POD_SANDBOX_CONFIG):
            pod = _pod_config(req.resources)
            return _pod_resources(pod), max(0, pod.linux.overhead.memory_limit_in_bytes), \
                dict(pod.annotations)
        if not url.endswith(LINUX_RESOURCES):
            raise TtrpcError(Code.INVALID_ARGUMENT,
                             f"update of sandbox {self.id}: resources of type {url!r}; "
                             f"podvm takes {LINUX_RESOURCES} or {POD_SANDBOX_CONFIG}")
        try:
            return parse_linux_resources(req.resources.value)[1], None, {}
        except ValueError as exc:
            raise TtrpcError(Code.INVALID_ARGUMENT,
                             f"update of sandbox {self.id}: {exc}") from None


def _pod_resources(pod) -> ContainerResources:
    """The pod's totals from a PodSandboxConfig (none set: no limits)."""
    from .resources import ContainerResources

    r = pod.linux.resources
    return ContainerResources(cpu_quota=r.cpu_quota, cpu_period=r.cpu_period,
                              cpu_shares=r.cpu_shares,
                              memory_limit=max(0, r.memory_limit_in_bytes),
                              cpuset=r.cpuset_cpus)


def _pod_config(options):
    """The PodSandboxConfig in an Any; None when there is none."""
    if not options.type_url:
        return None
    if not options.type_url.endswith(POD_SANDBOX_CONFIG):
        raise TtrpcError(Code.INVALID_ARGUMENT, f"sandbox options of type "
                                               f"{options.type_url!r}: podvm takes "
                                               f"{POD_SANDBOX_CONFIG}")
    from google.protobuf.message import DecodeError

    from .pb.cri import api_pb2 as cri

    try:
        return cri.PodSandboxConfig.FromString(options.value)
    except DecodeError as exc:
        raise TtrpcError(Code.INVALID_ARGUMENT,
                         f"sandbox options are not a PodSandboxConfig: {exc}") from None


def _cgroups_path(cgroup_parent: str, sandbox_id: str) -> str:
    """Where the sandbox container's cgroup would be, in the parent's syntax: the
    sandbox cgroup goes next to it, under the pod cgroup."""
    if not cgroup_parent:
        return ""
    if cgroup_parent.endswith(".slice"):
        return f"{cgroup_parent}:cri-containerd:{sandbox_id}"
    return f"{cgroup_parent.rstrip('/')}/{sandbox_id}"
