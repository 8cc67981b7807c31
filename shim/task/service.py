"""containerd.task.v2.Task (and v3): one thin handler per RPC — validate, find the
process, check its state, act through the pod's sandbox, publish the event."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from typing import TYPE_CHECKING, Callable

from google.protobuf.empty_pb2 import Empty

from .. import __version__, config, errors, guestspec, paths
from ..events import Publisher
from ..hypervisor import HypervisorError
from ..mounts import Mount
from ..pb.containerd.events import task_pb2 as events
from ..pb.containerd.runtimeoptions.v1.api_pb2 import Options
from ..pb.containerd.task.v2 import shim_pb2 as api
from ..pb.containerd.types.task_pb2 import ProcessInfo
from ..resources import ContainerResources, PlanError, SandboxPlan, StaticSizeExceeded
from ..resources.model import from_linux_resources
from ..stdio import ProcessIO, Stdio
from ..ttrpc import Code, Context, TtrpcError
from .process import Container, Process, State

if TYPE_CHECKING:
    from ..podplan import PodPlanner
    from ..sandbox import Sandbox

log = logging.getLogger("podvm.task")

RUNTIME_OPTIONS = "runtimeoptions.v1.Options"
CONTAINER_TYPE = "io.kubernetes.cri.container-type"
VM_GONE_STATUS = 255


class TaskService:
    def __init__(self, namespace: str, publisher: Publisher,
                 shutdown: Callable[[], None]) -> None:
        self.namespace = namespace
        self.containers: dict[str, Container] = {}
        self.sandbox: Sandbox | None = None
        self._sandbox_container = ""
        self._publisher = publisher
        self._shutdown = shutdown
        self._background: set[asyncio.Task] = set()
        self._planner: PodPlanner | None = None
        self._allocator = None
        self.pod_owner = None
        """The Sandbox API's service when it created this pod (no sandbox container)."""
        self._resizing = asyncio.Lock()
        self._vm_gone: HypervisorError | None = None
        """How the pod's QEMU ended, when it died under a running pod."""

    # --- lookups -------------------------------------------------------------------

    def _container(self, container_id: str) -> Container:
        container = self.containers.get(container_id)
        if container is None:
            raise TtrpcError(Code.NOT_FOUND, f"container {container_id!r} not found")
        return container

    def _process(self, container_id: str, exec_id: str = "") -> Process:
        return self._container(container_id).process(exec_id)

    def _agent(self):
        if self._vm_gone is not None:
            raise errors.to_ttrpc(self._vm_gone)
        if self.sandbox is None or self.sandbox.agent is None:
            raise TtrpcError(Code.FAILED_PRECONDITION, "the pod's VM is not running")
        return self.sandbox.agent

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _publish(self, topic: str, event) -> None:
        if self._publisher is not None:
            self._publisher.publish(topic, event)

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
        cfg = _load_config(req.options)
        annotations = spec.get("annotations") or {}
        boots_vm = self.sandbox is None
        if boots_vm and annotations.get(CONTAINER_TYPE) == "container":
            raise TtrpcError(Code.FAILED_PRECONDITION,
                             f"container {req.id} belongs to sandbox "
                             f"{annotations.get(paths.SANDBOX_ID_ANNOTATION)!r}, whose VM "
                             f"this shim does not run")
        if boots_vm and self.pod_owner is not None:
            raise TtrpcError(Code.FAILED_PRECONDITION,
                             f"container {req.id}: the pod's sandbox was created through the "
                             f"Sandbox API and is not started")
        if boots_vm:
            cgroups_path = (spec.get("linux") or {}).get("cgroupsPath") or ""
            await self.start_pod(req.id, cfg, _planner(cfg, spec, cgroups_path), cgroups_path)
        else:
            try:
                await self._resize(req.id, from_linux_resources(
                    (spec.get("linux") or {}).get("resources") or {}))
            except StaticRefusal:
                await self._resize(req.id, None, quiet=True)  # no container: nothing kept
                raise
        assert self.sandbox is not None
        guest = guestspec.rewrite(spec, req.id, self._guest_cpus(req.id))
        for what in guest.dropped:
            log.info("container %s: left out %s", req.id, what)
        rootfs = [Mount(m.type, m.source, tuple(m.options)) for m in req.rootfs]
        stdio = Stdio.of(req.stdin, req.stdout, req.stderr, req.terminal)
        try:
            self.sandbox.share(req.id, req.bundle, rootfs, guest.binds)
            await self._agent().create_container(req.id, json.dumps(guest.spec).encode(),
                                                 stdio, sandbox=boots_vm,
                                                 pod_holder=annotations.get(CONTAINER_TYPE)
                                                 == "sandbox")
        except BaseException as exc:
            await self._undo_create(req.id, boots_vm)
            if isinstance(exc, OSError):
                raise TtrpcError(Code.INVALID_ARGUMENT,
                                 f"cannot share the files of container {req.id} with its VM: "
                                 f"{exc}") from None
            if isinstance(exc, ValueError):
                raise TtrpcError(Code.INVALID_ARGUMENT, f"container {req.id}: {exc}") from None
            raise
        init = Process(req.id, pid=self.sandbox.pid, stdin=req.stdin, stdout=req.stdout,
                       stderr=req.stderr, terminal=req.terminal)
        init.io = ProcessIO(self._agent(), req.id, "", req.stdin, req.stdout, req.stderr,
                            req.terminal)
        init.io.start()
        self.containers[req.id] = Container(req.id, req.bundle, init)
        self._publish("/tasks/create", events.TaskCreate(
            container_id=req.id, bundle=req.bundle, rootfs=req.rootfs,
            io=events.TaskIO(stdin=req.stdin, stdout=req.stdout, stderr=req.stderr,
                             terminal=req.terminal), pid=init.pid))
        return api.CreateTaskResponse(pid=init.pid)

    async def boot_sandbox(self, container_id: str, cfg: config.Config,
                           plan: SandboxPlan, cgroups_path: str = "") -> None:
        """Boot the pod's VM from a computed plan; Task.Create of the sandbox container
        and the Sandbox API's StartSandbox both come here. `cgroups_path` is where the
        sandbox container's cgroup would be (cgroupfs or systemd syntax): the sandbox
        cgroup goes under its parent, the pod cgroup."""
        import cgroups  # the VM machinery loads with a pod's first Create

        from ..sandbox import Sandbox

        try:
            sandbox = Sandbox(self.namespace, container_id, cfg, plan, cgroups_path)
        except cgroups.CgroupError as exc:
            raise errors.to_ttrpc(exc, f"cgroup of sandbox {container_id}") from None
        for line in sandbox.plan.explanation:
            log.info("sandbox %s plan: %s", container_id, line)
        started = time.monotonic()
        try:
            await sandbox.boot()
        except cgroups.CgroupError as exc:
            raise errors.to_ttrpc(exc, "sandbox cgroup") from None
        except HypervisorError as exc:
            raise errors.to_ttrpc(exc) from None
        log.info("sandbox %s: VM ready in %.2fs", container_id, time.monotonic() - started)
        self.sandbox, self._sandbox_container = sandbox, container_id
        self._spawn(self._watch_vm(sandbox))
        self._spawn(self._watch_oom(sandbox))

    async def _undo_create(self, container_id: str, boots_vm: bool) -> None:
        if self.sandbox is None:
            return
        try:
            self.sandbox.unshare(container_id)
        except OSError as exc:
            log.error("container %s: cleanup after a failed create: %s", container_id, exc)
        if not boots_vm:
            await self._resize(container_id, None, quiet=True)
        if boots_vm:
            sandbox, self.sandbox = self.sandbox, None
            await sandbox.shutdown()

    async def start_pod(self, sandbox_id: str, cfg: config.Config, planner: PodPlanner,
                        cgroups_path: str) -> None:
        """Reserve the pod's CPUs (exclusive mode), plan and boot its VM; the sandbox
        container's Create and the Sandbox API's StartSandbox both come here."""
        allocator = self._reserve_cpus(sandbox_id, cfg, planner)
        try:
            planner.boot = _planned(planner.plan)
            await self.boot_sandbox(sandbox_id, cfg, planner.boot, cgroups_path)
        except BaseException:
            if allocator is not None:
                allocator.release(sandbox_id)
            raise
        self._planner, self._allocator = planner, allocator
        if planner.shared_pool is not None:
            self._spawn(self._watch_pool())

    async def update_pod(self, sandbox: ContainerResources) -> None:
        """The pod's own totals changed (the Sandbox API's UpdateSandbox): re-plan, apply."""
        await self._resize(None, None, sandbox=sandbox)

    def _reserve_cpus(self, sandbox_id: str, cfg: config.Config, planner: PodPlanner):
        """cpu_reservation = "exclusive": the pod's own CPUs from the node-wide allocator
        (an integral CPU request), or the shared pool. The allocator, or None."""
        if cfg.runtime.cpu_reservation != "exclusive":
            return None
        from ..cpus.allocator import Allocator, AllocatorError

        allocator = Allocator(reserved=cfg.runtime.reserved_cpus)
        count = planner.exclusive_request()
        if not count:
            planner.shared_pool = allocator.shared_pool
            return allocator
        try:
            planner.exclusive = allocator.reserve(sandbox_id, count)
        except AllocatorError as exc:  # NoFreeCPUs, or state it cannot trust
            raise TtrpcError(Code.RESOURCE_EXHAUSTED, f"podvm: {exc}") from None
        log.info("sandbox %s: exclusive host CPUs %s", sandbox_id, sorted(planner.exclusive))
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
                await self._resize(None, None, quiet=True)

    def _guest_cpus(self, container_id: str) -> list[int] | None:
        """The vCPUs a container's host cpuset maps to (pinned vCPUs), for its cpuset in
        the guest; None when it has no cpuset or nothing maps."""
        planner, sandbox = self._planner, self.sandbox
        if planner is None or sandbox is None:
            return None
        cpuset = planner.containers.get(container_id, ContainerResources()).cpuset
        if not cpuset:
            return None
        from cgroups.limits import parse_cpu_list

        from ..cpus.pinning import guest_cpus_for_update

        # Every vCPU when nothing maps (vCPUs floating): a cpuset set earlier in the guest
        # would otherwise stay, narrower than the container's CPUs now allow.
        return guest_cpus_for_update(parse_cpu_list(cpuset), sandbox.vcpu_pins) or None

    async def _confine(self, skip: str | None) -> None:
        """After the vCPUs were re-pinned: every other container's cpuset in the guest
        follows."""
        sandbox = self.sandbox
        if sandbox is None or sandbox.agent is None:
            return
        for cid, container in self.containers.items():
            if cid == skip or container.init.state is State.STOPPED:
                continue
            cpus = self._guest_cpus(cid)
            if cpus is None:
                continue
            try:
                await sandbox.agent.update(cid, json.dumps(
                    {"cpu": {"cpus": guestspec.cpu_list(cpus)}}).encode())
            except TtrpcError as exc:
                log.warning("container %s: guest cpuset: %s", cid, exc.message)

    async def _resize(self, container_id: str | None, resources: ContainerResources | None,
                      quiet: bool = False, sandbox: ContainerResources | None = None) -> None:
        """Re-plan the pod with `container_id` at `resources` (None: gone; no id: only the
        shared CPU pool changed) and apply the step: host cgroup limits, vCPUs and memory
        hot-plugged, vCPUs re-pinned, the guest told. All or nothing: on failure the plan
        in force stays. Growth a static-mode VM cannot take is the exception: what fits
        in the VM (limits, cpuset) is applied, then StaticRefusal is raised.
        `quiet`: failures are logged only (a shrink during cleanup)."""
        pod_totals, sandbox, planner = sandbox, self.sandbox, self._planner
        if sandbox is None or planner is None:
            return
        async with self._resizing:
            containers = dict(planner.containers)
            base = pod_totals
            if container_id is None:
                pass
            elif container_id == self._sandbox_container:
                base = resources or ContainerResources()  # ctr run: a container is its pod
            elif resources is None:
                containers.pop(container_id, None)
            else:
                containers[container_id] = resources
            import cgroups

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
                        raise errors.to_ttrpc(exc, f"resizing sandbox {sandbox.id}") from None
            except (TtrpcError, PlanError) as exc:
                if isinstance(exc, PlanError):
                    exc = _planning_error(exc)
                if not quiet:
                    raise exc from None
                log.warning("sandbox %s: re-plan without %s: %s", sandbox.id, container_id,
                            exc.message)
                return
            planner.commit(containers, base)
            if pins != sandbox.vcpu_pins:
                await self._confine(skip=container_id)
            if refusal is not None:
                raise StaticRefusal(f"podvm: {refusal} (applied what fits in the VM: "
                                    f"{'; '.join(delta.notes)})")

    async def _watch_vm(self, sandbox: Sandbox) -> None:
        assert sandbox.vm is not None
        await sandbox.vm.wait()
        if self.sandbox is not sandbox:
            return  # stopped on purpose
        self._vm_gone = await sandbox.vm.exited()
        log.error("sandbox %s: %s", sandbox.id, self._vm_gone)
        now = self.end_processes(VM_GONE_STATUS)
        if self.pod_owner is not None:
            self.pod_owner.vm_gone(VM_GONE_STATUS, now)

    async def _watch_oom(self, sandbox: Sandbox) -> None:
        while sandbox.agent is not None:
            try:
                container_id = await sandbox.agent.oom_event()
            except TtrpcError as exc:
                log.debug("OOM watch of sandbox %s ended: %s", sandbox.id, exc)
                return
            log.warning("container %s: out of memory in the guest", container_id)
            self._publish("/tasks/oom", events.TaskOOM(container_id=container_id))

    def _exited(self, proc: Process, status: int, at_ns: int) -> None:
        if proc.state is State.STOPPED:
            return
        proc.set_exited(status, at_ns)
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
        proc.check("start")
        agent = self._agent()
        if req.exec_id:
            await agent.exec_process(req.id, req.exec_id, proc.process_json, Stdio.of(
                proc.stdin, proc.stdout, proc.stderr, proc.terminal))
            proc.io = ProcessIO(agent, req.id, req.exec_id, proc.stdin, proc.stdout,
                                proc.stderr, proc.terminal)
            proc.io.start()
        else:
            await agent.start_container(req.id)
        proc.transition("start")
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
        proc.check("delete")
        if proc.state is State.CREATED and not req.exec_id:
            await self._kill_created(proc)
        proc.transition("delete")
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
        proc.exit_status, proc.exited_at_ns = 137, time.time_ns()

    async def _remove_container(self, container: Container) -> None:
        for exec_proc in container.execs.values():
            if exec_proc.io is not None:
                await exec_proc.io.close()
        del self.containers[container.id]
        sandbox = self.sandbox
        if sandbox is None:
            return
        if sandbox.agent is not None:
            try:
                await sandbox.agent.remove(container.id)
            except TtrpcError as exc:
                log.warning("container %s: removal in the guest: %s", container.id, exc)
        sandbox.unshare(container.id)
        if container.id == self._sandbox_container:
            await self.stop_pod()
        else:
            await self._resize(container.id, None, quiet=True)

    async def stop_pod(self) -> None:
        """Stop the VM and everything of the pod on the host; a no-op when stopped."""
        sandbox, self.sandbox = self.sandbox, None
        if sandbox is None:
            return
        log.info("sandbox %s: stopping the VM", sandbox.id)
        await sandbox.shutdown()
        if self._allocator is not None:
            self._allocator.release(sandbox.id)
        for task in list(self._background):
            task.cancel()

    def end_processes(self, status: int) -> int:
        """The VM is gone from under the pod's processes (it died, or the Sandbox API's
        StopSandbox stopped it): each one still alive has exited with `status`, and
        containerd hears it. The exit time (ns)."""
        now = time.time_ns()
        for container in list(self.containers.values()):
            for proc in (container.init, *container.execs.values()):
                if proc.state in (State.CREATED, State.RUNNING, State.PAUSED):
                    self._exited(proc, status, now)
        return now

    # --- processes -----------------------------------------------------------------

    async def Kill(self, req: api.KillRequest, ctx: Context) -> Empty:
        """As containerd's runc shim: a signal to a process that has exited answers
        NOT_FOUND "process already finished" (the guest says so when the exit is still
        on its way here); `all` to a stopped container still reaches the processes that
        outlived its init."""
        proc = self._process(req.id, req.exec_id)
        if not (req.all and not req.exec_id and proc.state is State.STOPPED):
            proc.check("kill")
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
        proc.check("pause")
        await self._agent().pause(req.id)
        proc.transition("pause")
        self._publish("/tasks/paused", events.TaskPaused(container_id=req.id))
        return Empty()

    async def Resume(self, req: api.ResumeRequest, ctx: Context) -> Empty:
        proc = self._process(req.id)
        proc.check("resume")
        await self._agent().resume(req.id)
        proc.transition("resume")
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
        from ..podplan import parse_linux_resources

        try:
            resources, wanted = parse_linux_resources(req.resources.value)
        except ValueError as exc:
            raise TtrpcError(Code.INVALID_ARGUMENT, f"update of {req.id}: {exc}") from None
        planner = self._planner
        before = None
        if planner is not None:
            before = planner.sandbox if req.id == self._sandbox_container else \
                planner.containers.get(req.id, ContainerResources())
        refused = None
        try:
            await self._resize(req.id, wanted)  # the host first: the guest gets room to grow
        except StaticRefusal as exc:
            refused = exc  # the container's own limits in the guest still apply
        try:
            await self._agent().update(req.id, json.dumps(guestspec.resources(
                resources, self._guest_cpus(req.id))).encode())
        except BaseException:
            if before is not None and refused is None:
                await self._resize(req.id, before, quiet=True)
            raise
        if refused is not None:
            raise refused
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
        await self.stop_pod()


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


def _planner(cfg: config.Config, spec: dict, cgroups_path: str) -> PodPlanner:
    """The pod's planning inputs from the sandbox container's spec and its pod cgroup."""
    from ..hostcgroup import pod_cgroup_limits
    from ..podplan import PodPlanner
    from ..sandbox import host

    memory_mib, cpus = pod_cgroup_limits(cgroups_path)
    return _planned(lambda: PodPlanner.for_sandbox(cfg, spec, host(), memory_mib, cpus))


class StaticRefusal(TtrpcError):
    """Growth a static-mode VM cannot take: refused, after what fits was applied."""

    def __init__(self, message: str) -> None:
        super().__init__(Code.FAILED_PRECONDITION, message)


def _planning_error(exc: Exception) -> TtrpcError:
    """A planning error as the status code it means; a value the model could not read
    is the request's fault."""
    answer = errors.to_ttrpc(exc)
    if answer.code is Code.UNKNOWN:
        return TtrpcError(Code.INVALID_ARGUMENT, answer.message)
    return answer


def _planned(compute):
    """Run a planning step; its errors as the status codes they mean."""
    try:
        return compute()
    except (PlanError, ValueError, TypeError) as exc:
        raise _planning_error(exc) from None


def _load_config(options) -> config.Config:
    config_path = ""
    if options.type_url.endswith(RUNTIME_OPTIONS):
        config_path = Options.FromString(options.value).config_path
    try:
        return config.load(config_path)
    except config.ConfigError as exc:
        raise TtrpcError(Code.INVALID_ARGUMENT, f"podvm configuration: {exc}") from None
