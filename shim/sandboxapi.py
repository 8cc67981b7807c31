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
import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Callable

from .pb.containerd.runtime.sandbox.v1 import sandbox_pb2 as api
from .ttrpc import Code, Context, TtrpcError

if TYPE_CHECKING:
    from .config import Config
    from .podplan import PodPlanner
    from .task.service import TaskService

log = logging.getLogger("podvm.sandboxapi")

POD_SANDBOX_CONFIG = "runtime.v1.PodSandboxConfig"
LINUX_RESOURCES = "LinuxResources"
READY, NOT_READY = "SANDBOX_READY", "SANDBOX_NOTREADY"
MIB = 1 << 20


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
        resources = linux.resources if linux is not None else None
        overhead = linux.overhead if linux is not None else None
        base = ContainerResources(
            cpu_quota=resources.cpu_quota, cpu_period=resources.cpu_period,
            cpu_shares=resources.cpu_shares, memory_limit=max(0, resources.memory_limit_in_bytes),
            cpuset=resources.cpuset_cpus) if resources is not None else ContainerResources()
        annotations = dict(pod.annotations) if pod is not None else {}
        annotations.update(req.annotations)
        pod_memory_mib = 0
        if base.memory_limit and overhead is not None:
            # kubelet's pod cgroup: the containers' limits plus the RuntimeClass overhead
            pod_memory_mib = (base.memory_limit + max(0, overhead.memory_limit_in_bytes)) // MIB
        self._overhead_bytes = max(0, overhead.memory_limit_in_bytes) if overhead else 0
        cgroup_parent = linux.cgroup_parent if linux is not None else ""
        planner = _planned(lambda: PodPlanner(cfg, annotations, base, host(), pod_memory_mib))
        plan = _planned(planner.plan)  # refused here, before anything boots
        for line in plan.explanation:
            log.info("sandbox %s plan: %s", req.sandbox_id, line)
        self.id, self.phase = req.sandbox_id, Phase.CREATED
        self._config, self._planner = cfg, planner
        self._cgroups_path = _cgroups_path(cgroup_parent, req.sandbox_id)
        self.tasks.pod_owner = self
        return api.CreateSandboxResponse()

    async def StartSandbox(self, req: api.StartSandboxRequest,
                           ctx: Context) -> api.StartSandboxResponse:
        if self.phase is None and req.sandbox_id:
            raise TtrpcError(Code.FAILED_PRECONDITION if not self.id else Code.NOT_FOUND,
                             f"sandbox {req.sandbox_id!r} was not created: CreateSandbox first")
        self._check(req.sandbox_id, Phase.CREATED)
        assert self._config is not None and self._planner is not None
        await self.tasks.start_pod(self.id, self._config, self._planner, self._cgroups_path)
        sandbox = self.tasks.sandbox
        assert sandbox is not None and sandbox.agent is not None
        try:
            holder = await sandbox.agent.create_pod_namespaces()
        except TtrpcError:
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
        self._check(req.sandbox_id)
        if self.phase is Phase.READY:
            timeout = req.timeout_secs or None
            try:
                await asyncio.wait_for(self.tasks.stop_pod(), timeout)
            except TimeoutError:
                raise TtrpcError(Code.DEADLINE_EXCEEDED, f"sandbox {self.id} did not stop "
                                                         f"within {timeout}s") from None
            self._stopped(0, time.time_ns())
        elif self.phase is Phase.CREATED:
            self._stopped(0, time.time_ns())
        return api.StopSandboxResponse()

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
            plan = sandbox.plan if ready else (self._planner.boot if self._planner else None)
            if plan is not None:
                response.info["plan"] = json.dumps(asdict(plan))
            response.info["phase"] = self.phase.value if self.phase else ""
            if ready:
                vcpus, memory = await sandbox.vm.size()
                response.info["vm"] = json.dumps({"vcpus": vcpus, "memory_mib": memory})
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
        if self.phase is Phase.READY:
            await self.tasks.stop_pod()
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
        """New pod totals (LinuxResources JSON or a PodSandboxConfig): re-plan and apply
        through the same path as Task.Update."""
        self._check(req.sandbox_id, Phase.READY)
        from .podplan import parse_linux_resources

        url = req.resources.type_url
        if url.endswith(POD_SANDBOX_CONFIG):
            r = _pod_config(req.resources).linux.resources
            raw = json.dumps({"cpu": {"quota": r.cpu_quota, "period": r.cpu_period,
                                      "shares": r.cpu_shares, "cpus": r.cpuset_cpus},
                              "memory": {"limit": r.memory_limit_in_bytes}}).encode()
        elif url.endswith(LINUX_RESOURCES):
            raw = req.resources.value
        else:
            raise TtrpcError(Code.INVALID_ARGUMENT,
                             f"update of sandbox {self.id}: resources of type {url!r}; "
                             f"podvm takes {LINUX_RESOURCES} or {POD_SANDBOX_CONFIG}")
        try:
            _, wanted = parse_linux_resources(raw)
        except ValueError as exc:
            raise TtrpcError(Code.INVALID_ARGUMENT,
                             f"update of sandbox {self.id}: {exc}") from None
        assert self._planner is not None
        if req.annotations:
            self._planner.annotations.update(req.annotations)
        if self._planner.pod_cgroup_memory_mib and wanted.memory_limit:
            # kubelet resizes the pod cgroup with the pod: its limits plus the overhead
            self._planner.pod_cgroup_memory_mib = (wanted.memory_limit
                                                   + self._overhead_bytes) // MIB
        await self.tasks.update_pod(wanted)
        return api.UpdateSandboxResponse()


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
