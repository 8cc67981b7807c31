"""containerd.runtime.sandbox.v1.Sandbox: containerd 2.x's "shim" sandboxer hands the
pod sandbox itself to the shim, with the whole PodSandboxConfig (resources, overhead,
cgroup parent) before anything boots. No pause container: the VM is the sandbox, and a
process in the guest holds the pod's namespaces. Containers then come through the Task
API of the same shim. The flow: docs/design.md, Through the Sandbox API.

States: (none) -CreateSandbox-> created -StartSandbox-> ready -StopSandbox/VM exit->
stopped; ShutdownSandbox ends the shim from any of them."""
from __future__ import annotations

import asyncio
import enum
import logging
import time
from typing import TYPE_CHECKING, Callable

from google.protobuf.message import DecodeError

from podvm_core.pb.containerd.runtime.sandbox.v1 import sandbox_pb2 as api
from podvm_core.pb.cri import api_pb2 as cri
from podvm_core.ttrpc import Code, Context, TtrpcError

# The daemon loads this module at the first Sandbox API call (shim/contract/daemon.py), so the
# pod's machinery is imported here at the top: a sandbox is about to need it.
from ..options import load_config, saved_options
from ...pod.pod import Pod
from ...pod.exitstatus import VM_GONE_STATUS
from ...pod.podslot import PodSlot
from ...resources.planner import parse_linux_resources, pod_cgroup_memory_mib, pod_resources
from .request import pod_request

if TYPE_CHECKING:
    from ...resources import ContainerResources

log = logging.getLogger("podvm.sandboxapi")

POD_SANDBOX_CONFIG = "runtime.v1.PodSandboxConfig"
LINUX_RESOURCES = "LinuxResources"
READY, NOT_READY = "SANDBOX_READY", "SANDBOX_NOTREADY"
STOP_TIMEOUT = 10
"""Seconds StopSandbox gives the pod's processes to die when the request sets none."""


class Phase(enum.Enum):
    CREATED = "created"
    READY = "ready"
    STOPPED = "stopped"


class SandboxService:
    def __init__(self, slot: PodSlot, namespace: str, shutdown: Callable[[], None]) -> None:
        self.slot = slot
        self.namespace = namespace
        self._shutdown = shutdown
        self.id = ""
        self.phase: Phase | None = None
        self._pod: Pod | None = None
        self._overhead_bytes = 0
        self._created_at_ns = 0
        self._exited_at_ns = 0
        self._exit_status = 0
        self._exited = asyncio.Event()
        self._transition = asyncio.Lock()
        """One Start, Stop or Shutdown at a time: a second waits, then sees the phase."""

    # --- state ------------------------------------------------------------------------

    def _check(self, sandbox_id: str, *phases: Phase) -> Pod:
        if not sandbox_id:
            raise TtrpcError(Code.INVALID_ARGUMENT, "the sandbox id is empty")
        if self._pod is None or sandbox_id != self.id:
            raise TtrpcError(Code.NOT_FOUND, f"sandbox {sandbox_id!r} not found"
                             + (f" (this shim serves {self.id!r})" if self.id else ""))
        if phases and self.phase not in phases:
            wanted = " or ".join(p.value for p in phases)
            raise TtrpcError(Code.FAILED_PRECONDITION,
                             f"sandbox {sandbox_id} is {self.phase.value}, not {wanted}")
        return self._pod

    # what the pod tells
    def vm_exited(self, error, status: int) -> None:
        if self.phase is Phase.READY:
            self._stopped(status)

    def vm_stopped(self) -> None:
        if self.phase is Phase.READY:
            self._stopped(0)

    def container_oom(self, container_id: str) -> None:
        pass  # the Task API reports it

    def _stopped(self, status: int) -> None:
        self.phase = Phase.STOPPED
        self._exit_status, self._exited_at_ns = status, time.time_ns()
        self._exited.set()

    # --- RPCs -------------------------------------------------------------------------

    async def CreateSandbox(self, req: api.CreateSandboxRequest,
                            ctx: Context) -> api.CreateSandboxResponse:
        """Validate and plan from the PodSandboxConfig, write the pod's /etc files;
        nothing boots yet."""
        if not req.sandbox_id:
            raise TtrpcError(Code.INVALID_ARGUMENT, "create: the sandbox id is empty")
        if self.slot.pod is not None:
            raise TtrpcError(Code.ALREADY_EXISTS, f"this shim already serves the pod "
                                                  f"{self.slot.pod.id!r}")
        cfg = load_config(saved_options(req.bundle_path))
        pod_config = _pod_config(req.options) or cri.PodSandboxConfig()
        pod = Pod.create(pod_request(self.namespace, req.sandbox_id, pod_config,
                                     {**pod_config.annotations, **req.annotations},
                                     req.netns_path), cfg, self.slot.network_worker)
        if req.netns_path:
            # Started now, it is ready when StartSandbox boots the pod.
            await self.slot.network_worker.start()
        pod.listen(self)
        self.slot.take(pod)
        self.slot.sandbox_api_owner = req.sandbox_id
        self.id, self.phase, self._pod = req.sandbox_id, Phase.CREATED, pod
        self._overhead_bytes = max(0, pod_config.linux.overhead.memory_limit_in_bytes)
        return api.CreateSandboxResponse()

    async def StartSandbox(self, req: api.StartSandboxRequest,
                           ctx: Context) -> api.StartSandboxResponse:
        if self.phase is None and req.sandbox_id:
            raise TtrpcError(Code.FAILED_PRECONDITION if not self.id else Code.NOT_FOUND,
                             f"sandbox {req.sandbox_id!r} was not created: CreateSandbox first")
        async with self._transition:
            pod = self._check(req.sandbox_id, Phase.CREATED)
            # A failed boot leaves nothing: Start may be tried again.
            await pod.boot()
            try:
                holder = await pod.hold_namespaces()
            except BaseException:
                # The VM is gone with the slot's hold on it: this sandbox is over, and a
                # second Start must not boot a pod the Task API would never see.
                await pod.stop()
                self._stopped(VM_GONE_STATUS)
                raise
            log.info("sandbox %s: ready, QEMU %d, pod namespaces held by guest pid %d",
                     self.id, pod.pid, holder)
            self.phase, self._created_at_ns = Phase.READY, time.time_ns()
            response = api.StartSandboxResponse(pid=pod.pid)
            response.created_at.FromNanoseconds(self._created_at_ns)
            return response

    async def Platform(self, req: api.PlatformRequest, ctx: Context) -> api.PlatformResponse:
        self._check(req.sandbox_id)
        response = api.PlatformResponse()
        response.platform.os, response.platform.architecture = "linux", "amd64"
        return response

    async def StopSandbox(self, req: api.StopSandboxRequest,
                          ctx: Context) -> api.StopSandboxResponse:
        """The pod's containers get `timeout_secs` to die of SIGKILL, then the VM stops;
        a process still alive then is reported killed."""
        pod = self._check(req.sandbox_id)
        async with self._transition:
            await pod.stop(grace=req.timeout_secs or STOP_TIMEOUT)
            await self.slot.close()  # a worker kept for a boot that will not come
            if self.phase is not Phase.STOPPED:
                self._stopped(0)
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
        pod = self._check(req.sandbox_id)
        ready = self.phase is Phase.READY and pod.booted
        response = api.SandboxStatusResponse(sandbox_id=self.id, pid=pod.pid if ready else 0,
                                             state=READY if ready else NOT_READY)
        if self._created_at_ns:
            response.created_at.FromNanoseconds(self._created_at_ns)
        if self._exited_at_ns:
            response.exited_at.FromNanoseconds(self._exited_at_ns)
        if req.verbose:
            response.info.update(await pod.status())
            response.info["phase"] = self.phase.value if self.phase else ""
        return response

    async def PingSandbox(self, req: api.PingRequest, ctx: Context) -> api.PingResponse:
        pod = self._check(req.sandbox_id, Phase.READY)
        await pod.ping(timeout=10)
        return api.PingResponse()

    async def ShutdownSandbox(self, req: api.ShutdownSandboxRequest,
                              ctx: Context) -> api.ShutdownSandboxResponse:
        pod = self._check(req.sandbox_id)
        async with self._transition:
            await pod.stop(grace=STOP_TIMEOUT)
            await self.slot.close()  # a worker kept for a boot that will not come
            if self.phase is not Phase.STOPPED:
                self._stopped(0)
        log.info("sandbox %s: shutdown", self.id)
        self.slot.sandbox_api_owner = ""
        self._shutdown()
        return api.ShutdownSandboxResponse()

    async def SandboxMetrics(self, req: api.SandboxMetricsRequest,
                             ctx: Context) -> api.SandboxMetricsResponse:
        pod = self._check(req.sandbox_id, Phase.READY)
        response = api.SandboxMetricsResponse()
        response.metrics.id = self.id
        response.metrics.timestamp.FromNanoseconds(time.time_ns())
        response.metrics.data.CopyFrom(pod.metrics())
        return response

    async def UpdateSandbox(self, req: api.UpdateSandboxRequest,
                            ctx: Context) -> api.UpdateSandboxResponse:
        """New pod totals (LinuxResources JSON or a PodSandboxConfig) and annotations:
        re-planned and applied through the same path as Task.Update, all or nothing."""
        pod = self._check(req.sandbox_id, Phase.READY)
        wanted, overhead, annotations = self._update_inputs(pod, req)
        annotations.update(req.annotations)
        overhead_bytes = self._overhead_bytes if overhead is None else overhead
        memory_mib = None
        if pod.resizer.planner.pod_cgroup_memory_mib or wanted.memory_limit:
            # kubelet resizes the pod cgroup with the pod: its limits plus the overhead
            memory_mib = pod_cgroup_memory_mib(wanted.memory_limit, overhead_bytes)
        await pod.resizer.update_totals(wanted, annotations, memory_mib)
        self._overhead_bytes = overhead_bytes
        log.info("sandbox %s: updated to %s", self.id, wanted)
        return api.UpdateSandboxResponse()

    def _update_inputs(self, pod: Pod, req: api.UpdateSandboxRequest
                       ) -> tuple[ContainerResources, int | None, dict[str, str]]:
        """(the pod's new totals, its new overhead in bytes or None, annotations)."""
        url = req.resources.type_url
        if not url:
            if not req.annotations:
                raise TtrpcError(Code.INVALID_ARGUMENT, f"update of sandbox {self.id}: "
                                                        f"neither resources nor annotations")
            return pod.resizer.planner.sandbox, None, {}
        if url.endswith(POD_SANDBOX_CONFIG):
            pod_config = _pod_config(req.resources)
            return pod_resources(pod_config), \
                max(0, pod_config.linux.overhead.memory_limit_in_bytes), \
                dict(pod_config.annotations)
        if not url.endswith(LINUX_RESOURCES):
            raise TtrpcError(Code.INVALID_ARGUMENT,
                             f"update of sandbox {self.id}: resources of type {url!r}; "
                             f"podvm takes {LINUX_RESOURCES} or {POD_SANDBOX_CONFIG}")
        try:
            return parse_linux_resources(req.resources.value)[1], None, {}
        except ValueError as exc:
            raise TtrpcError(Code.INVALID_ARGUMENT,
                             f"update of sandbox {self.id}: {exc}") from None


def _pod_config(options):
    """The PodSandboxConfig in an Any; None when there is none."""
    if not options.type_url:
        return None
    if not options.type_url.endswith(POD_SANDBOX_CONFIG):
        raise TtrpcError(Code.INVALID_ARGUMENT, f"sandbox options of type "
                                               f"{options.type_url!r}: podvm takes "
                                               f"{POD_SANDBOX_CONFIG}")
    try:
        return cri.PodSandboxConfig.FromString(options.value)
    except DecodeError as exc:
        raise TtrpcError(Code.INVALID_ARGUMENT,
                         f"sandbox options are not a PodSandboxConfig: {exc}") from None

