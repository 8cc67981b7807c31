"""containerd.task.v2.Task (and v3): one thin handler per RPC — validate, find the
process, check its state, act, publish the event."""
from __future__ import annotations

import logging
import os
from typing import Callable

from google.protobuf.empty_pb2 import Empty

from .. import __version__, config, paths
from ..events import Publisher
from ..pb.containerd.runtimeoptions.v1.api_pb2 import Options
from ..pb.containerd.task.v2 import shim_pb2 as api
from ..ttrpc import Code, Context, TtrpcError
from .process import Container, Process, State

log = logging.getLogger("podvm.task")

RUNTIME_OPTIONS = "runtimeoptions.v1.Options"


def _no_vm(operation: str, container_id: str) -> TtrpcError:
    return TtrpcError(
        Code.UNIMPLEMENTED,
        f"podvm cannot {operation} container {container_id}: this build of podvm has no VM "
        f"backend yet (QEMU driver and guest agent), so it cannot run containers")


class TaskService:
    def __init__(self, publisher: Publisher, shutdown: Callable[[], None]) -> None:
        self.containers: dict[str, Container] = {}
        self._publisher = publisher
        self._shutdown = shutdown

    def _container(self, container_id: str) -> Container:
        container = self.containers.get(container_id)
        if container is None:
            raise TtrpcError(Code.NOT_FOUND, f"container {container_id!r} not found")
        return container

    def _process(self, container_id: str, exec_id: str = "") -> Process:
        return self._container(container_id).process(exec_id)

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
        _read_bundle(req.bundle)
        _load_config(req.options)
        raise _no_vm("create", req.id)

    async def Start(self, req: api.StartRequest, ctx: Context) -> api.StartResponse:
        self._process(req.id, req.exec_id).check("start")
        raise _no_vm("start", req.id)

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
        proc.check("delete")
        if proc.state is State.CREATED:
            raise _no_vm("delete a created", req.id)
        proc.transition("delete")
        if req.exec_id:
            del container.execs[req.exec_id]
        else:
            del self.containers[req.id]
        response = api.DeleteResponse(pid=proc.pid, exit_status=proc.exit_status)
        response.exited_at.FromNanoseconds(proc.exited_at_ns)
        return response

    async def Kill(self, req: api.KillRequest, ctx: Context) -> Empty:
        self._process(req.id, req.exec_id).check("kill")
        raise _no_vm("signal", req.id)

    async def Exec(self, req: api.ExecProcessRequest, ctx: Context) -> Empty:
        container = self._container(req.id)
        if req.exec_id in container.execs:
            raise TtrpcError(Code.ALREADY_EXISTS,
                             f"exec {req.exec_id} of container {req.id} already exists")
        container.init.check("exec")
        raise _no_vm("exec in", req.id)

    async def ResizePty(self, req: api.ResizePtyRequest, ctx: Context) -> Empty:
        self._process(req.id, req.exec_id).check("resize")
        raise _no_vm("resize the terminal of", req.id)

    async def CloseIO(self, req: api.CloseIORequest, ctx: Context) -> Empty:
        self._process(req.id, req.exec_id).check("closeio")
        raise _no_vm("close the stdin of", req.id)

    async def Pause(self, req: api.PauseRequest, ctx: Context) -> Empty:
        self._process(req.id).check("pause")
        raise _no_vm("pause", req.id)

    async def Resume(self, req: api.ResumeRequest, ctx: Context) -> Empty:
        self._process(req.id).check("resume")
        raise _no_vm("resume", req.id)

    async def Pids(self, req: api.PidsRequest, ctx: Context) -> api.PidsResponse:
        self._container(req.id)
        raise _no_vm("list the processes of", req.id)

    async def Stats(self, req: api.StatsRequest, ctx: Context) -> api.StatsResponse:
        self._container(req.id)
        raise _no_vm("read the stats of", req.id)

    async def Update(self, req: api.UpdateTaskRequest, ctx: Context) -> Empty:
        self._process(req.id).check("update")
        raise _no_vm("update", req.id)

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
