"""containerd.task.v2.Task (and v3): one thin handler per RPC — validate, find the
process, check its state, act through the Pod, publish the event."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import time
from typing import TYPE_CHECKING, Callable

from google.protobuf.empty_pb2 import Empty

from podvm_core.pb.containerd.events import task_pb2 as events
from podvm_core.pb.containerd.task.v2 import shim_pb2 as api
from podvm_core.pb.containerd.types.task_pb2 import ProcessInfo
from podvm_core.procstate import CREATED, STOPPED
from podvm_core.ttrpc import Code, Context, TtrpcError

from ... import __version__
from ...host import paths
from ..errors import to_ttrpc
from ..events import Publisher
from ..options import load_config
from ...host.mounts import Mount
from ...pod.errors import NotRunning, PodError
from ...pod.exitstatus import KILLED_STATUS
from ...pod.podslot import PodSlot
from ...vm.stdio import Stdio
from .bundle import read_bundle
from .reporting import Reporter
from .process import Container, Process, status_of

if TYPE_CHECKING:
    from ...vm.hypervisor import HypervisorError
    from ...pod.pod import Pod

log = logging.getLogger("podvm.task")

CONTAINER_TYPE = "io.kubernetes.cri.container-type"
IDLE_EXIT = 30.0
"""Seconds a shim whose last container is gone waits for containerd's Shutdown before it
exits on its own: containerd sends none after a Delete that outlived its deadline (it has
given up on the task), and such a shim would otherwise stay forever."""


class TaskService:
    def __init__(self, namespace: str, publisher: Publisher,
                 shutdown: Callable[[], None], slot: PodSlot | None = None) -> None:
        """`slot`: the daemon's, shared with the Sandbox API (a slot of its own if none)."""
        self.namespace = namespace
        self.containers: dict[str, Container] = {}
        self.slot = slot or PodSlot()
        self.slot.listen(self)
        self.report = Reporter(publisher, self.containers)
        self._shutdown = shutdown
        self._removals: set[asyncio.Future] = set()
        self._idle_exit: asyncio.TimerHandle | None = None

    def _container(self, container_id: str) -> Container:
        container = self.containers.get(container_id)
        if container is None:
            raise TtrpcError(Code.NOT_FOUND, f"container {container_id!r} not found")
        return container

    def _process(self, container_id: str, exec_id: str = "") -> Process:
        return self._container(container_id).process(exec_id)

    def _pod(self) -> Pod:
        if self.slot.pod is None:
            raise to_ttrpc(NotRunning())
        return self.slot.pod

    def _guest_seconds(self) -> float:
        return self.slot.pod.vm.guest_seconds() if self.slot.pod is not None else 0.0

    def _log_time(self, container_id: str, what: str, started: float, guest: float) -> None:
        """How long a container's step took here, and how much of it the host waited for
        the guest (the rest is the host's share: bench/pod_bench.py reads this line)."""
        log.info("container %s %s in %.3fs, of which the guest %.3fs", container_id, what,
                 time.monotonic() - started, max(0.0, self._guest_seconds() - guest))

    # what the pod tells
    def vm_exited(self, error: HypervisorError, status: int) -> None:
        self.report.end(self.containers.values(), status)

    def vm_stopped(self) -> None:
        self.report.end(self.containers.values(), KILLED_STATUS)

    def container_oom(self, container_id: str) -> None:
        self.report.oom(container_id)

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
        if self._idle_exit is not None:
            self._idle_exit.cancel()
            self._idle_exit = None
        started, guest = time.monotonic(), self._guest_seconds()
        spec = read_bundle(req.bundle)
        pod, owns_vm = await self._pod_for(req, spec)
        await pod.add_container(
            req.id, req.bundle, spec, [Mount(m.type, m.source, tuple(m.options))
                                       for m in req.rootfs],
            Stdio.of(req.stdin, req.stdout, req.stderr, req.terminal), owns_vm=owns_vm,
            pod_holder=(spec.get("annotations") or {}).get(CONTAINER_TYPE) == "sandbox")
        self._log_time(req.id, "created", started, guest)
        init = Process(req.id, pid=pod.pid, stdin=req.stdin, stdout=req.stdout,
                       stderr=req.stderr, terminal=req.terminal)
        init.io = pod.containers.process_io(req.id, "", req.stdin, req.stdout, req.stderr,
                                            req.terminal)
        init.io.start()
        self.containers[req.id] = Container(req.id, req.bundle, init)
        self.report.publish("/tasks/create", events.TaskCreate(
            container_id=req.id, bundle=req.bundle, rootfs=req.rootfs,
            io=events.TaskIO(stdin=req.stdin, stdout=req.stdout, stderr=req.stderr,
                             terminal=req.terminal), pid=init.pid))
        return api.CreateTaskResponse(pid=init.pid)

    async def _pod_for(self, req: api.CreateTaskRequest, spec: dict) -> tuple[Pod, bool]:
        """The pod the container goes into, and whether its Create boots the VM (it owns
        the VM: the sandbox container's Create plans and boots the pod)."""
        annotations = spec.get("annotations") or {}
        pod = self.slot.pod
        if pod is not None:
            if not pod.booted:
                raise TtrpcError(Code.FAILED_PRECONDITION,
                                 f"container {req.id}: the pod's sandbox was created through "
                                 f"the Sandbox API and is not started")
            return pod, False
        if annotations.get(CONTAINER_TYPE) == "container":
            raise TtrpcError(Code.FAILED_PRECONDITION,
                             f"container {req.id} belongs to sandbox "
                             f"{annotations.get(paths.SANDBOX_ID_ANNOTATION)!r}, whose VM this "
                             f"shim does not run")
        cfg = load_config(req.options)
        # Both here, not at the top: the VM machinery loads with a pod's first Create.
        from ...pod.pod import Pod
        from .request import pod_request  # likewise

        # With the slot's network worker, which the daemon started for this pod when it
        # came up (the pod's boot starts it where the daemon has not).
        pod = Pod.create(pod_request(self.namespace, req.id, spec), cfg,
                         self.slot.network_worker)
        self.slot.take(pod)
        try:
            await pod.boot()
        except BaseException:
            self.slot.pod = None
            raise
        return pod, True

    async def Start(self, req: api.StartRequest, ctx: Context) -> api.StartResponse:
        container = self._container(req.id)
        proc = container.process(req.exec_id)
        started, guest = time.monotonic(), self._guest_seconds()
        async with proc.acting("start"):
            pod = self._pod()
            if req.exec_id:
                proc.io = await pod.containers.exec_process(
                    req.id, req.exec_id, proc.process_json, proc.stdin, proc.stdout,
                    proc.stderr, proc.terminal)
                proc.io.start()
            else:
                await pod.containers.start(req.id)
                self._log_time(req.id, "started", started, guest)
        self.report.watch(proc, self._pod)
        if req.exec_id:
            self.report.publish("/tasks/exec-started", events.TaskExecStarted(
                container_id=req.id, exec_id=req.exec_id, pid=proc.pid))
        else:
            self.report.publish("/tasks/start",
                                events.TaskStart(container_id=req.id, pid=proc.pid))
        return api.StartResponse(pid=proc.pid)

    async def State(self, req: api.StateRequest, ctx: Context) -> api.StateResponse:
        container = self._container(req.id)
        proc = container.process(req.exec_id)
        response = api.StateResponse(
            id=req.id, exec_id=req.exec_id, bundle=container.bundle, pid=proc.pid,
            status=status_of(proc.state), stdin=proc.stdin, stdout=proc.stdout,
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
            if proc.state is CREATED and not req.exec_id:  # runc's init waits in the guest
                with contextlib.suppress(TtrpcError, PodError):
                    await self._pod().signal(req.id, "", 9, True)
                proc.exit_status, proc.exited_at_ns = KILLED_STATUS, time.time_ns()
        await proc.stop_io()
        if req.exec_id:
            await proc.forget_in_guest(self._pod)
            del container.execs[req.exec_id]
        else:
            # Once begun, a removal finishes even when containerd's deadline passes (the
            # ttrpc server then cancels this handler): half a teardown would leave the VM
            # running with nothing left to stop it.
            removal = asyncio.ensure_future(self._remove_container(container))
            self._removals.add(removal)
            removal.add_done_callback(self._removed)
            await asyncio.shield(removal)
        response = api.DeleteResponse(pid=proc.pid, exit_status=proc.exit_status)
        response.exited_at.FromNanoseconds(proc.exited_at_ns or time.time_ns())
        if not req.exec_id:
            self.report.deleted(proc, response.exited_at)
        return response

    async def _remove_container(self, container: Container) -> None:
        """The container stays (deleted, for State) until it is removed: containerd 1.6's
        StopPodSandbox takes a sandbox container it cannot find for one already stopped,
        and would answer before its removal (the VM's stop) is over, when the exits came
        before it (a VM that died, or was killed for not answering); nor does the shim
        shut down meanwhile."""
        for exec_proc in list(container.execs.values()):  # an exec's Delete may end meanwhile
            await exec_proc.stop_io()
        try:
            pod = self.slot.pod
            if pod is not None:
                await pod.remove_container(container.id, owns_vm=container.id == pod.id)
        finally:
            del self.containers[container.id]

    def _removed(self, removal: asyncio.Future) -> None:
        self._removals.discard(removal)
        if not removal.cancelled() and removal.exception() is not None:
            log.error("removing a container: %s", removal.exception())
        if not self.containers and not self.slot.sandbox_api_owner and self._idle_exit is None:
            self._idle_exit = asyncio.get_running_loop().call_later(IDLE_EXIT, self._exit_idle)

    def _exit_idle(self) -> None:
        self._idle_exit = None
        if not self.containers and not self.slot.sandbox_api_owner and not self._removals:
            log.warning("no Shutdown came %.0fs after the last container went (containerd "
                        "gave up on its Delete?): exiting", IDLE_EXIT)
            self._shutdown()

    async def Kill(self, req: api.KillRequest, ctx: Context) -> Empty:
        """As containerd's runc shim: a signal to a process that has exited answers
        NOT_FOUND "process already finished" (the guest says so when the exit is still
        on its way here); `all` to a stopped container still reaches the processes that
        outlived its init. A guest that does not answer in time has its VM killed, and
        the signal is done (Pod.signal); so has SIGKILL to the pod's sandbox container."""
        proc = self._process(req.id, req.exec_id)
        async with proc.acting("kill_all" if req.all and not req.exec_id else "kill"):
            leftovers = proc.state is STOPPED
            pod = self._pod()
            if req.signal == signal.SIGKILL and not req.exec_id and req.id == pod.id and \
                    pod.vm.machine is not None and not leftovers:
                # The pod's sandbox container (StopPodSandbox kills it last): the VM is the
                # sandbox, killed at once with whatever runs in it, each reported exited 137,
                # rather than a signal through a guest that may be slow (issue 47).
                await pod.kill_vm(pod.vm.machine, "its sandbox container was killed",
                                  asked=True)
                return Empty()
            try:
                await pod.signal(req.id, req.exec_id, req.signal, req.all)
            except (TtrpcError, PodError) as exc:
                if not leftovers:
                    raise
                raise TtrpcError(Code.NOT_FOUND, f"{proc.name}: process already finished "
                                                 f"({to_ttrpc(exc).message})") from None
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
        self.report.publish("/tasks/exec-added",
                            events.TaskExecAdded(container_id=req.id, exec_id=req.exec_id))
        return Empty()

    async def ResizePty(self, req: api.ResizePtyRequest, ctx: Context) -> Empty:
        self._process(req.id, req.exec_id).check("resize")
        await self._pod().containers.resize_pty(req.id, req.exec_id, req.width,
                                                req.height)
        return Empty()

    async def CloseIO(self, req: api.CloseIORequest, ctx: Context) -> Empty:
        proc = self._process(req.id, req.exec_id)
        proc.check("close_io")
        if req.stdin and proc.io is not None:
            await proc.io.close_stdin()
        return Empty()

    async def Pause(self, req: api.PauseRequest, ctx: Context) -> Empty:
        proc = self._process(req.id)
        async with proc.acting("pause"):
            await self._pod().containers.pause(req.id)
        self.report.publish("/tasks/paused", events.TaskPaused(container_id=req.id))
        return Empty()

    async def Resume(self, req: api.ResumeRequest, ctx: Context) -> Empty:
        proc = self._process(req.id)
        async with proc.acting("resume"):
            await self._pod().containers.resume(req.id)
        self.report.publish("/tasks/resumed", events.TaskResumed(container_id=req.id))
        return Empty()

    async def Pids(self, req: api.PidsRequest, ctx: Context) -> api.PidsResponse:
        self._container(req.id)
        processes = await self._pod().containers.pids(req.id)
        return api.PidsResponse(processes=[ProcessInfo(pid=p.pid) for p in processes])

    async def Stats(self, req: api.StatsRequest, ctx: Context) -> api.StatsResponse:
        """The guest's Metrics, checked by the agent's client (shim/vm/agent.py)."""
        self._container(req.id)
        return api.StatsResponse(stats=await self._pod().containers.stats(req.id))

    async def Update(self, req: api.UpdateTaskRequest, ctx: Context) -> Empty:
        self._process(req.id).check("update")
        await self._pod().resizer.update_container(req.id, req.resources.value)
        return Empty()

    async def Checkpoint(self, req: api.CheckpointTaskRequest, ctx: Context) -> Empty:
        self._container(req.id)
        raise TtrpcError(Code.UNIMPLEMENTED, "podvm does not checkpoint VM containers")

    async def Shutdown(self, req: api.ShutdownRequest, ctx: Context) -> Empty:
        if self.containers and not req.now:
            log.info("shutdown requested with %d container(s) left: staying up",
                     len(self.containers))
            return Empty()
        if self.slot.sandbox_api_owner and not req.now:
            log.info("shutdown requested: staying up for sandbox %s until its "
                     "ShutdownSandbox", self.slot.sandbox_api_owner)
            return Empty()
        log.info("shutting down%s", " now" if req.now else "")
        self._shutdown()
        return Empty()

    async def close(self) -> None:
        """The daemon is exiting: stop the VM if it still runs."""
        for container in list(self.containers.values()):
            for proc in (container.init, *container.execs.values()):
                await proc.stop_io()
        if self.slot.pod is not None:
            await self.slot.pod.stop()
