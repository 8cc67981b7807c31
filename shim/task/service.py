"""containerd.task.v2.Task (and v3): one thin handler per RPC — validate, find the
process, check its state, act through the Pod, publish the event."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from typing import TYPE_CHECKING, Callable

from google.protobuf.empty_pb2 import Empty

from .. import __version__, config, paths
from ..events import Publisher
from ..mounts import Mount
from ..pb.containerd.events import task_pb2 as events
from ..pb.containerd.runtimeoptions.v1.api_pb2 import Options
from ..pb.containerd.task.v2 import shim_pb2 as api
from ..pb.containerd.types.task_pb2 import ProcessInfo
from ..pod.slot import KILLED_STATUS, VM_GONE_STATUS, PodSlot
from ..stdio import ProcessIO, Stdio
from ..ttrpc import Code, Context, TtrpcError
from .process import Container, Process, State

if TYPE_CHECKING:
    from ..hypervisor import HypervisorError
    from ..pod.pod import Pod

log = logging.getLogger("podvm.task")

RUNTIME_OPTIONS = "runtimeoptions.v1.Options"
CONTAINER_TYPE = "io.kubernetes.cri.container-type"


class TaskService:
    def __init__(self, namespace: str, publisher: Publisher,
                 shutdown: Callable[[], None], slot: PodSlot | None = None) -> None:
        self.namespace = namespace
        self.containers: dict[str, Container] = {}
        self.slot = slot or PodSlot()
        self.slot.listen(self)
        self._publisher = publisher
        self._shutdown = shutdown
        self._background: set[asyncio.Task] = set()

    # --- lookups -------------------------------------------------------------------

    def _container(self, container_id: str) -> Container:
        container = self.containers.get(container_id)
        if container is None:
            raise TtrpcError(Code.NOT_FOUND, f"container {container_id!r} not found")
        return container

    def _process(self, container_id: str, exec_id: str = "") -> Process:
        return self._container(container_id).process(exec_id)

    def _agent(self):
        pod = self.slot.pod
        if pod is None:
            raise TtrpcError(Code.FAILED_PRECONDITION, "the pod's VM is not running")
        return pod.agent

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _publish(self, topic: str, event) -> None:
        if self._publisher is not None:
            self._publisher.publish(topic, event)

    # --- what the pod tells ---------------------------------------------------------

    def vm_exited(self, error: HypervisorError) -> None:
        self.end_processes(VM_GONE_STATUS)

    def vm_stopped(self) -> None:
        self.end_processes(KILLED_STATUS)

    def container_oom(self, container_id: str) -> None:
        self._publish("/tasks/oom", events.TaskOOM(container_id=container_id))

    def end_processes(self, status: int) -> int:
        """The VM is gone from under the pod's processes: each one still alive has
        exited with `status`, and containerd hears it. The exit time (ns)."""
        now = time.time_ns()
        for container in list(self.containers.values()):
            for proc in (container.init, *container.execs.values()):
                if proc.state in (State.CREATED, State.RUNNING, State.PAUSED):
                    self._exited(proc, status, now)
        return now

    # --- lifecycle -----------------------------------------------------------------

    async def Connect(self, req: api.ConnectRequest, ctx: Context) -> api.ConnectResponse:
        container = self.containers.get(req.id)
        return api.ConnectResponse(shim_pid=os.getpid(),
                                   task_pid=container.init.pid if container else 0,
                                   version=__version__)

    async def Create(self, req: api.CreateTaskRequest, ctx: Context) -> api.CreateTaskResponse:
        if not req.id:
            raise TtrpcError(Code.INVALID_ARGUMENT, "create: the container id is empty")
        if req.id in self.containers:
            raise TtrpcError(Code.ALREADY_EXISTS, f"container {req.id!r} already exists")
        spec = _read_bundle(req.bundle)
        annotations = spec.get("annotations") or {}
        pod, holder = self.slot.pod, self.slot.pod is None
        if holder:
            if annotations.get(CONTAINER_TYPE) == "container":
                raise TtrpcError(Code.FAILED_PRECONDITION,
                                 f"container {req.id} belongs to sandbox "
                                 f"{annotations.get(paths.SANDBOX_ID_ANNOTATION)!r}, whose VM "
                                 f"this shim does not run")
            pod = await self._boot_pod(req.id, _load_config(req.options), spec)
        elif not pod.booted:
            raise TtrpcError(Code.FAILED_PRECONDITION,
                             f"container {req.id}: the pod's sandbox was created through the "
                             f"Sandbox API and is not started")
        assert pod is not None
        stdio = Stdio.of(req.stdin, req.stdout, req.stderr, req.terminal)
        try:
            await pod.add_container(
                req.id, req.bundle, spec,
                [Mount(m.type, m.source, tuple(m.options)) for m in req.rootfs], stdio,
                holder=holder, pod_holder=annotations.get(CONTAINER_TYPE) == "sandbox")
        except BaseException:
            if holder:
                self.slot.pod = None  # its VM is stopped: the next sandbox boots anew
            raise
        init = Process(req.id, pid=pod.pid, stdin=req.stdin, stdout=req.stdout,
                       stderr=req.stderr, terminal=req.terminal)
        init.io = ProcessIO(pod.agent, req.id, "", req.stdin, req.stdout, req.stderr,
                            req.terminal)
        init.io.start()
        self.containers[req.id] = Container(req.id, req.bundle, init)
        self._publish("/tasks/create", events.TaskCreate(
            container_id=req.id, bundle=req.bundle, rootfs=req.rootfs,
            io=events.TaskIO(stdin=req.stdin, stdout=req.stdout, stderr=req.stderr,
                             terminal=req.terminal), pid=init.pid))
        return api.CreateTaskResponse(pid=init.pid)

    async def _boot_pod(self, sandbox_id: str, cfg: config.Config, spec: dict) -> Pod:
        """The sandbox container's Create: its pod, planned from its spec and the pod
        cgroup kubelet made, booted."""
        from ..hostcgroup import pod_cgroup_limits  # the VM machinery loads with a pod
        from ..pod.pod import Pod, planned
        from ..pod.planner import PodPlanner
        from ..sandbox import host

        cgroups_path = (spec.get("linux") or {}).get("cgroupsPath") or ""
        memory_mib, cpus = pod_cgroup_limits(cgroups_path)
        planner = planned(lambda: PodPlanner.for_sandbox(cfg, spec, host(), memory_mib, cpus))
        pod = Pod(self.namespace, sandbox_id, cfg, planner, cgroups_path)
        self.slot.take(pod)
        try:
            await pod.boot()
        except BaseException:
            self.slot.pod = None
            raise
        return pod

    def _exited(self, proc: Process, status: int, at_ns: int) -> None:
        if proc.state is State.STOPPED:
            return
        proc.set_exited(status, at_ns)
        if not proc.exec_id and self.slot.pod is not None:
            self.slot.pod.container_stopped(proc.container_id)
        event = events.TaskExit(container_id=proc.container_id,
                                id=proc.exec_id or proc.container_id, pid=proc.pid,
                                exit_status=status)
        event.exited_at.FromNanoseconds(at_ns)
        self._publish("/tasks/exit", event)

    async def _reap(self, proc: Process) -> None:
        """Wait for the guest process to exit, let its output drain, report the exit."""
        try:
            result = await self._agent().wait(proc.container_id, proc.exec_id)
            status, at_ns = result.exit_status, result.exited_at.ToNanoseconds()
        except TtrpcError as exc:
            log.warning("%s: lost track of the process: %s", proc.name, exc)
            status, at_ns = VM_GONE_STATUS, time.time_ns()
        if proc.io is not None:
            await proc.io.drained()
        self._exited(proc, status, at_ns or time.time_ns())

    async def Start(self, req: api.StartRequest, ctx: Context) -> api.StartResponse:
        container = self._container(req.id)
        proc = container.process(req.exec_id)
        async with proc.acting("start"):
            agent = self._agent()
            if req.exec_id:
                await agent.exec_process(req.id, req.exec_id, proc.process_json, Stdio.of(
                    proc.stdin, proc.stdout, proc.stderr, proc.terminal))
                proc.io = ProcessIO(agent, req.id, req.exec_id, proc.stdin, proc.stdout,
                                    proc.stderr, proc.terminal)
                proc.io.start()
            else:
                await agent.start_container(req.id)
        self._spawn(self._reap(proc))
        if req.exec_id:
            self._publish("/tasks/exec-started", events.TaskExecStarted(
                container_id=req.id, exec_id=req.exec_id, pid=proc.pid))
        else:
            self._publish("/tasks/start", events.TaskStart(container_id=req.id, pid=proc.pid))
        return api.StartResponse(pid=proc.pid)

    async def State(self, req: api.StateRequest, ctx: Context) -> api.StateResponse:
        container = self._container(req.id)
        proc = container.process(req.exec_id)
        response = api.StateResponse(
            id=req.id, exec_id=req.exec_id, bundle=container.bundle, pid=proc.pid,
            status=proc.state.status, stdin=proc.stdin, stdout=proc.stdout,
            stderr=proc.stderr, terminal=proc.terminal, exit_status=proc.exit_status)
        if proc.exited_at_ns:
            response.exited_at.FromNanoseconds(proc.exited_at_ns)
        return response

    async def Wait(self, req: api.WaitRequest, ctx: Context) -> api.WaitResponse:
        status, at_ns = await self._process(req.id, req.exec_id).wait()
        response = api.WaitResponse(exit_status=status)
        response.exited_at.FromNanoseconds(at_ns)
        return response

    async def Delete(self, req: api.DeleteRequest, ctx: Context) -> api.DeleteResponse:
        container = self._container(req.id)
        proc = container.process(req.exec_id)
        async with proc.acting("delete"):
            if proc.state is State.CREATED and not req.exec_id:
                await self._kill_created(proc)
        if proc.io is not None:
            await proc.io.close()
        if req.exec_id:
            del container.execs[req.exec_id]
        else:
            await self._remove_container(container)
        response = api.DeleteResponse(pid=proc.pid, exit_status=proc.exit_status)
        response.exited_at.FromNanoseconds(proc.exited_at_ns or time.time_ns())
        if not req.exec_id:
            event = events.TaskDelete(container_id=req.id, id=req.id, pid=proc.pid,
                                      exit_status=proc.exit_status)
            event.exited_at.CopyFrom(response.exited_at)
            self._publish("/tasks/delete", event)
        return response

    async def _kill_created(self, proc: Process) -> None:
        """A container deleted before it started: its runc init exists in the guest."""
        try:
            await self._agent().signal(proc.container_id, "", 9, True)
        except TtrpcError as exc:
            log.debug("%s: kill before delete: %s", proc.name, exc)
        proc.exit_status, proc.exited_at_ns = KILLED_STATUS, time.time_ns()

    async def _remove_container(self, container: Container) -> None:
        for exec_proc in container.execs.values():
            if exec_proc.io is not None:
                await exec_proc.io.close()
        del self.containers[container.id]
        pod = self.slot.pod
        if pod is not None:
            holder = container.id == pod.id
            await pod.remove_container(container.id, holder=holder)
            if holder:
                self.slot.pod = None

    # --- processes -----------------------------------------------------------------

    async def Kill(self, req: api.KillRequest, ctx: Context) -> Empty:
        """As containerd's runc shim: a signal to a process that has exited answers
        NOT_FOUND "process already finished" (the guest says so when the exit is still
        on its way here); `all` to a stopped container still reaches the processes that
        outlived its init."""
        proc = self._process(req.id, req.exec_id)
        if not (req.all and not req.exec_id and proc.state is State.STOPPED):
            async with proc.acting("kill"):
                await self._agent().signal(req.id, req.exec_id, req.signal, req.all)
            return Empty()
        try:
            await self._agent().signal(req.id, "", req.signal, True)
        except TtrpcError as exc:
            raise TtrpcError(Code.NOT_FOUND, f"{proc.name}: process already finished "
                                             f"({exc.message})") from None
        return Empty()

    async def Exec(self, req: api.ExecProcessRequest, ctx: Context) -> Empty:
        container = self._container(req.id)
        if not req.exec_id:
            raise TtrpcError(Code.INVALID_ARGUMENT, f"exec in {req.id}: the exec id is empty")
        if req.exec_id in container.execs:
            raise TtrpcError(Code.ALREADY_EXISTS,
                             f"exec {req.exec_id} of container {req.id} already exists")
        container.init.check("exec")
        try:
            json.loads(req.spec.value)
        except ValueError as exc:
            raise TtrpcError(Code.INVALID_ARGUMENT,
                             f"exec {req.exec_id}: the process spec is not JSON: {exc}") from None
        container.execs[req.exec_id] = Process(
            req.id, exec_id=req.exec_id, pid=container.init.pid, stdin=req.stdin,
            stdout=req.stdout, stderr=req.stderr, terminal=req.terminal,
            process_json=req.spec.value)
        self._publish("/tasks/exec-added", events.TaskExecAdded(container_id=req.id,
                                                                exec_id=req.exec_id))
        return Empty()

    async def ResizePty(self, req: api.ResizePtyRequest, ctx: Context) -> Empty:
        self._process(req.id, req.exec_id).check("resize")
        await self._agent().resize(req.id, req.exec_id, req.width, req.height)
        return Empty()

    async def CloseIO(self, req: api.CloseIORequest, ctx: Context) -> Empty:
        proc = self._process(req.id, req.exec_id)
        proc.check("closeio")
        if req.stdin and proc.io is not None:
            await proc.io.close_stdin()
        return Empty()

    async def Pause(self, req: api.PauseRequest, ctx: Context) -> Empty:
        proc = self._process(req.id)
        async with proc.acting("pause"):
            await self._agent().pause(req.id)
        self._publish("/tasks/paused", events.TaskPaused(container_id=req.id))
        return Empty()

    async def Resume(self, req: api.ResumeRequest, ctx: Context) -> Empty:
        proc = self._process(req.id)
        async with proc.acting("resume"):
            await self._agent().resume(req.id)
        self._publish("/tasks/resumed", events.TaskResumed(container_id=req.id))
        return Empty()

    async def Pids(self, req: api.PidsRequest, ctx: Context) -> api.PidsResponse:
        self._container(req.id)
        processes = await self._agent().pids(req.id)
        return api.PidsResponse(processes=[ProcessInfo(pid=p.pid) for p in processes])

    async def Stats(self, req: api.StatsRequest, ctx: Context) -> api.StatsResponse:
        self._container(req.id)
        stats = await self._agent().stats(req.id)
        return api.StatsResponse(stats=stats.metrics)

    async def Update(self, req: api.UpdateTaskRequest, ctx: Context) -> Empty:
        self._process(req.id).check("update")
        from ..pod.planner import parse_linux_resources

        try:
            resources, wanted = parse_linux_resources(req.resources.value)
        except ValueError as exc:
            raise TtrpcError(Code.INVALID_ARGUMENT, f"update of {req.id}: {exc}") from None
        pod = self.slot.pod
        if pod is None:
            raise TtrpcError(Code.FAILED_PRECONDITION, "the pod's VM is not running")
        await pod.update_container(req.id, resources, wanted)
        return Empty()

    async def Checkpoint(self, req: api.CheckpointTaskRequest, ctx: Context) -> Empty:
        self._container(req.id)
        raise TtrpcError(Code.UNIMPLEMENTED, "podvm does not checkpoint VM containers")

    async def Shutdown(self, req: api.ShutdownRequest, ctx: Context) -> Empty:
        if self.containers and not req.now:
            log.info("shutdown requested with %d container(s) left: staying up",
                     len(self.containers))
            return Empty()
        log.info("shutting down%s", " now" if req.now else "")
        self._shutdown()
        return Empty()

    async def close(self) -> None:
        """The daemon is exiting: stop the VM if it still runs."""
        for container in list(self.containers.values()):
            for proc in (container.init, *container.execs.values()):
                if proc.io is not None:
                    await proc.io.close()
        if self.slot.pod is not None:
            await self.slot.pod.stop()


def _read_bundle(bundle: str) -> dict:
    if not bundle or not os.path.isdir(bundle):
        raise TtrpcError(Code.INVALID_ARGUMENT, f"bundle {bundle!r} is not a directory")
    try:
        spec = paths.read_spec(bundle)
    except (ValueError, OSError) as exc:
        raise TtrpcError(Code.INVALID_ARGUMENT,
                         f"bundle {bundle}: config.json is not a readable OCI spec: {exc}")
    if not isinstance(spec, dict):
        raise TtrpcError(Code.INVALID_ARGUMENT, f"bundle {bundle} has no OCI spec (config.json)")
    return spec


def _load_config(options) -> config.Config:
    config_path = ""
    if options.type_url.endswith(RUNTIME_OPTIONS):
        config_path = Options.FromString(options.value).config_path
    try:
        return config.load(config_path)
    except config.ConfigError as exc:
        raise TtrpcError(Code.INVALID_ARGUMENT, f"podvm configuration: {exc}") from None
