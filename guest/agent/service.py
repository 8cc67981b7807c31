"""podvm.agent.v1.Agent: what the shim asks of the guest."""
from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import os
import struct
import time
from typing import TYPE_CHECKING

from google.protobuf.empty_pb2 import Empty

from podvm_core.pb.agent import agent_pb2 as pb
from podvm_core.procstate import finished
from podvm_core.ttrpc import Code, Context, TtrpcError

# resume: loaded at the start, so that it is in every template's memory and no
# restored guest imports it (under TCG an import on the restore path costs 0.1 s)
from . import (containers, holder, kill, libc, network, oci, quota, resources, resume, runc,
               scratchgrow, volumes, writable)
from .containers import Container
from .oom import OOMKills

if TYPE_CHECKING:
    from .portforward import PortForwards

log = logging.getLogger("podvm.agent")

VERSION = "0.1.0"


class AgentService:
    def __init__(self) -> None:
        self.containers: dict[str, Container] = {}
        self.oom_kills = OOMKills()
        self._pod_namespaces: containers.Process | None = None
        """The holder of the pod's namespaces when no sandbox container does."""
        self._network = asyncio.Lock()
        self._forwards: "PortForwards | None" = None
        """Port forwards' connections, made at the first (the module loads then)."""
        self._forgetting: set[asyncio.Task] = set()
        """Removed containers' layers being deleted after the answer (RemoveContainer)."""

    def _container(self, container_id: str) -> Container:
        container = self.containers.get(container_id)
        if container is None:
            raise TtrpcError(Code.NOT_FOUND, f"container {container_id!r} not found in the guest")
        return container

    def _sandbox_pid(self) -> int:
        for c in self.containers.values():
            if c.sandbox:
                return c.init.pid
        return self._pod_namespaces.pid if self._pod_namespaces else 0

    async def CreatePodNamespaces(self, req: pb.CreatePodNamespacesRequest,
                                  ctx: Context) -> pb.CreatePodNamespacesResponse:
        """The pod of a Sandbox-API sandbox (no sandbox container). Idempotent."""
        if self._pod_namespaces is None or self._pod_namespaces.exited.is_set():
            self._pod_namespaces = await holder.start("pod", req.hostname, req.sysctls)
        return pb.CreatePodNamespacesResponse(pid=self._pod_namespaces.pid)

    async def Resume(self, req: pb.ResumeRequest, ctx: Context) -> Empty:
        """A guest restored from a template made this pod's (guest/agent/resume.py)."""
        async with self._network:
            await resume.resume(req)
        return Empty()

    async def ConfigureNetwork(self, req: pb.ConfigureNetworkRequest, ctx: Context) -> Empty:
        """The guest's interfaces as the pod's (guest/agent/network.py). Idempotent; one
        call at a time."""
        async with self._network:
            await network.configure(req)
        return Empty()

    def _port_forwards(self) -> "PortForwards":
        if self._forwards is None:
            from .portforward import PortForwards  # only when a pod forwards a port

            self._forwards = PortForwards()
        return self._forwards

    async def OpenPortForward(self, req: pb.OpenPortForwardRequest,
                              ctx: Context) -> pb.OpenPortForwardResponse:
        stream_id, address = await self._port_forwards().open(req.port)
        return pb.OpenPortForwardResponse(stream_id=stream_id, address=address)

    async def ReadPortForward(self, req: pb.ReadPortForwardRequest,
                              ctx: Context) -> pb.ReadStreamResponse:
        return pb.ReadStreamResponse(
            data=await self._port_forwards().read(req.stream_id, req.max_bytes))

    async def WritePortForward(self, req: pb.WritePortForwardRequest,
                               ctx: Context) -> pb.WriteStreamResponse:
        return pb.WriteStreamResponse(
            written=await self._port_forwards().write(req.stream_id, req.data))

    async def ClosePortForward(self, req: pb.ClosePortForwardRequest, ctx: Context) -> Empty:
        self._port_forwards().close(req.stream_id, req.write_only)
        return Empty()

    async def Ping(self, req: pb.PingRequest, ctx: Context) -> pb.PingResponse:
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        cpus, memory = resources.online()
        return pb.PingResponse(agent_version=VERSION, kernel_release=os.uname().release,
                               online_cpus=cpus, memory_total_bytes=memory,
                               uptime_seconds=uptime)

    async def CreateContainer(self, req: pb.CreateContainerRequest,
                              ctx: Context) -> pb.CreateContainerResponse:
        if req.container_id in self.containers:
            raise TtrpcError(Code.ALREADY_EXISTS, f"container {req.container_id} exists")
        try:
            spec = json.loads(req.spec_json)
        except ValueError as exc:
            raise TtrpcError(Code.INVALID_ARGUMENT, f"spec is not JSON: {exc}") from None
        if req.pod_holder:  # the pod's hostname and sysctls come in the sandbox's spec
            sysctls = (spec.get("linux") or {}).get("sysctl") or {}
            container = Container(req.container_id, True,
                                  await holder.start(req.container_id, spec.get("hostname", ""),
                                                     sysctls=sysctls),
                                  holder=True)
            self.containers[req.container_id] = container
            return pb.CreateContainerResponse(pid=container.init.pid)
        root = (spec.get("root") or {}).get("path", "")
        limit, volume_limits = quota.limits(spec)
        volumes.make(req.local_dirs, volume_limits)
        if req.rootfs_lower:  # its writable layer on the scratch disk
            writable.make(req.container_id, req.rootfs_lower, root, limit)
        elif not os.path.isdir(root):
            raise TtrpcError(Code.INVALID_ARGUMENT,
                             f"container {req.container_id}: rootfs {root!r} is not shared")
        spec = oci.guest_spec(spec, req.container_id, self._sandbox_pid())
        try:
            container = await containers.create(req.container_id, spec, req.stdio,
                                                req.sandbox)
        except BaseException:
            if req.rootfs_lower:
                writable.remove(req.container_id, root)
            raise
        container.layer_root = root if req.rootfs_lower else ""
        self.containers[req.container_id] = container
        self.oom_kills.watch(req.container_id)
        log.info("created %s (pid %d)", req.container_id, container.init.pid)
        return pb.CreateContainerResponse(pid=container.init.pid)

    async def StartContainer(self, req: pb.StartContainerRequest,
                             ctx: Context) -> pb.StartContainerResponse:
        container = self._container(req.container_id)
        async with container.init.acting("start"):
            if not container.holder:  # a holder runs from its creation
                await runc.runc(req.container_id, "start", req.container_id)
        return pb.StartContainerResponse(pid=container.init.pid)

    async def ExecProcess(self, req: pb.ExecProcessRequest,
                          ctx: Context) -> pb.ExecProcessResponse:
        """A new process in a running container; its init's lock is held meanwhile, so
        that the container is neither paused nor removed under it."""
        container = self._container(req.container_id)
        try:
            process = json.loads(req.process_json)
        except ValueError as exc:
            raise TtrpcError(Code.INVALID_ARGUMENT, f"process is not JSON: {exc}") from None
        async with container.init.acting("exec"):
            if req.exec_id in container.execs:
                raise TtrpcError(Code.ALREADY_EXISTS, f"exec {req.exec_id} exists")
            proc = await containers.exec_process(container, req.exec_id, process, req.stdio)
            container.execs[req.exec_id] = proc
        return pb.ExecProcessResponse(pid=proc.pid)

    async def SignalProcess(self, req: pb.SignalProcessRequest, ctx: Context) -> Empty:
        """A process that has already exited, or exits while the signal is on its way,
        answers NOT_FOUND "process already finished", as containerd's runc shim does
        (the CRI reads it as stopped). `all` reaches every process of the container,
        also after its init has exited: workers may outlive it."""
        container = self._container(req.container_id)
        proc = container.process(req.exec_id)
        every = req.all and not req.exec_id and not container.holder
        async with proc.acting("kill_all" if every else "kill"):
            try:
                if req.exec_id:
                    os.kill(proc.pid, req.signal)
                elif container.holder:
                    holder.signal(proc, req.signal)
                else:
                    await kill.signal_container(req.container_id, proc.pid, req.signal,
                                                req.all)
            except ProcessLookupError:
                raise finished(proc.name, proc.state) from None
            except TtrpcError as exc:
                if exc.code == Code.NOT_FOUND or runc.not_running(exc.message):
                    raise finished(proc.name, proc.state) from None
                raise
        return Empty()

    async def WaitProcess(self, req: pb.WaitProcessRequest,
                          ctx: Context) -> pb.WaitProcessResponse:
        proc = self._container(req.container_id).process(req.exec_id)
        await proc.exited.wait()
        response = pb.WaitProcessResponse(exit_status=proc.exit_status or 0, oom_killed=(
            not req.exec_id and self.oom_kills.take_at_exit(req.container_id)))
        response.exited_at.FromNanoseconds(proc.exited_at_ns)
        return response

    async def ListPids(self, req: pb.ListPidsRequest, ctx: Context) -> pb.ListPidsResponse:
        container = self._container(req.container_id)
        if container.holder:
            return pb.ListPidsResponse(processes=[pb.ProcessEntry(pid=container.init.pid)])
        out = await runc.runc(req.container_id, "ps", "--format", "json", req.container_id)
        execs = {p.pid: e for e, p in container.execs.items()}
        return pb.ListPidsResponse(processes=[pb.ProcessEntry(pid=pid, exec_id=execs.get(pid, ""))
                                              for pid in json.loads(out or b"[]") or []])

    async def ContainerStats(self, req: pb.ContainerStatsRequest,
                             ctx: Context) -> pb.ContainerStatsResponse:
        self._container(req.container_id)
        return pb.ContainerStatsResponse(metrics=resources.metrics(req.container_id))

    async def UpdateContainer(self, req: pb.UpdateContainerRequest, ctx: Context) -> Empty:
        container = self._container(req.container_id)
        async with container.init.acting("update"):
            if container.holder:
                return Empty()  # holds namespaces, uses nothing worth limiting
            path = os.path.join(runc.bundle_dir(req.container_id), "update.json")
            with open(path, "wb") as f:
                f.write(req.resources_json)
            await runc.runc(req.container_id, "update", "--resources", path, req.container_id)
        return Empty()

    async def PauseContainer(self, req: pb.PauseContainerRequest, ctx: Context) -> Empty:
        container = self._container(req.container_id)
        async with container.init.acting("pause"):
            if container.holder:
                _freeze(req.container_id, True)
            else:
                await runc.runc(req.container_id, "pause", req.container_id)
        return Empty()

    async def ResumeContainer(self, req: pb.ResumeContainerRequest, ctx: Context) -> Empty:
        container = self._container(req.container_id)
        async with container.init.acting("resume"):
            if container.holder:
                _freeze(req.container_id, False)
            else:
                await runc.runc(req.container_id, "resume", req.container_id)
        return Empty()

    async def RemoveContainer(self, req: pb.RemoveContainerRequest, ctx: Context) -> Empty:
        """Only a container whose init was never started or has exited: the shim kills
        first (a holder, which runs from its creation, is killed here)."""
        container = self._container(req.container_id)
        async with container.init.acting("delete"):
            if container.holder:
                if not container.init.exited.is_set():
                    holder.signal(container.init, 9)
                    await container.init.exited.wait()
                holder.remove_cgroup(req.container_id)
            elif not (container.init.exited.is_set() and
                      await kill.remove_exited(req.container_id)):
                try:
                    await runc.runc(req.container_id, "delete", "--force", req.container_id)
                except TtrpcError as exc:
                    if exc.code != Code.NOT_FOUND:
                        raise
            for proc in (container.init, *container.execs.values()):
                proc.close()
            del self.containers[req.container_id]
        layer = time.monotonic()
        if container.layer_root:  # what the container wrote goes with it, after the answer
            await asyncio.to_thread(writable.unmount, container.layer_root)
            task = asyncio.ensure_future(asyncio.to_thread(writable.forget, req.container_id))
            self._forgetting.add(task)
            task.add_done_callback(self._forgetting.discard)
        layer = time.monotonic() - layer
        self.oom_kills.forget(req.container_id)
        import shutil  # only now: every import before the agent serves costs boot time

        shutil.rmtree(runc.bundle_dir(req.container_id), ignore_errors=True)
        for leftover in (runc.log_path(req.container_id),):
            try:
                os.unlink(leftover)
            except FileNotFoundError:
                pass
        log.info("removed %s (its root unmounted in %.3fs; its layer goes next)",
                 req.container_id, layer)
        return Empty()

    async def RemoveProcess(self, req: pb.RemoveProcessRequest, ctx: Context) -> Empty:
        """The shim's Delete of an exec: without it the agent would keep every exec a
        container ever ran (kubelet's exec probes, one every few seconds, for the life
        of the container), with its stdio, and refuse its id again. Its own RPC rather
        than an exec id on RemoveContainer, where the id's empty default would remove
        the whole container, or a forget on WaitProcess, which may be asked more than
        once and answers before the host has drained the exec's output: only the host's
        Delete says the host is done with it. Only an exited exec (the state model
        refuses a running one); NOT_FOUND once forgotten, which the shim takes as done."""
        if not req.exec_id:
            raise TtrpcError(Code.INVALID_ARGUMENT, f"container {req.container_id}: no exec "
                                                    f"id (an init goes with its container)")
        container = self._container(req.container_id)
        proc = container.process(req.exec_id)
        async with proc.acting("delete"):
            proc.close()
            del container.execs[req.exec_id]
        log.debug("forgot %s (%d exec(s) left)", proc.name, len(container.execs))
        return Empty()

    async def _read(self, req: pb.ReadStreamRequest, name: str) -> pb.ReadStreamResponse:
        proc = self._container(req.container_id).process(req.exec_id)
        stream = proc.stream(name)
        if stream is None:
            return pb.ReadStreamResponse()
        return pb.ReadStreamResponse(data=await stream.read(req.max_bytes or 65536))

    async def ReadStdout(self, req: pb.ReadStreamRequest, ctx: Context) -> pb.ReadStreamResponse:
        return await self._read(req, "stdout")

    async def ReadStderr(self, req: pb.ReadStreamRequest, ctx: Context) -> pb.ReadStreamResponse:
        return await self._read(req, "stderr")

    async def WriteStdin(self, req: pb.WriteStreamRequest,
                         ctx: Context) -> pb.WriteStreamResponse:
        proc = self._container(req.container_id).process(req.exec_id)
        stream = proc.stream("stdin")
        if stream is None or stream.fd < 0:
            raise TtrpcError(Code.FAILED_PRECONDITION, "the process has no open stdin")
        return pb.WriteStreamResponse(written=await stream.write(req.data))

    async def CloseStdin(self, req: pb.CloseStdinRequest, ctx: Context) -> Empty:
        proc = self._container(req.container_id).process(req.exec_id)
        if proc.pty is None and proc.stdin is not None:
            proc.stdin.close()
        elif proc.pty is not None:
            await proc.pty.write(b"\x04")  # end of file on a terminal
        return Empty()

    async def ResizeTty(self, req: pb.ResizeTtyRequest, ctx: Context) -> Empty:
        proc = self._container(req.container_id).process(req.exec_id)
        if proc.pty is None:
            raise TtrpcError(Code.FAILED_PRECONDITION, "the process has no terminal")
        import termios  # only for a terminal: the agent boots without it

        fcntl.ioctl(proc.pty.fd, termios.TIOCSWINSZ,
                    struct.pack("HHHH", req.height, req.width, 0, 0))
        return Empty()

    async def OnlineCPUMem(self, req: pb.OnlineCPUMemRequest,
                           ctx: Context) -> pb.OnlineCPUMemResponse:
        deadline = time.monotonic() + 10
        while True:
            resources.online_hotplugged(req.cpus)
            cpus, memory = resources.online()
            done = cpus >= req.wait_cpus and memory >= req.wait_memory_bytes and (
                not req.cpus or cpus == req.cpus)
            if done or time.monotonic() > deadline:
                return pb.OnlineCPUMemResponse(online_cpus=cpus, memory_total_bytes=memory)
            await asyncio.sleep(0.05)

    async def GrowScratch(self, req: pb.GrowScratchRequest,
                          ctx: Context) -> pb.GrowScratchResponse:
        return pb.GrowScratchResponse(filesystem_bytes=await scratchgrow.grow(req.size_bytes))

    async def GetOOMEvent(self, req: pb.GetOOMEventRequest, ctx: Context) -> pb.OOMEvent:
        return pb.OOMEvent(container_id=await self.oom_kills.next())

    async def Shutdown(self, req: pb.ShutdownRequest, ctx: Context) -> Empty:
        log.info("shutdown: stopping %d container(s)", len(self.containers))
        for container_id in list(self.containers):
            try:
                await kill.signal_container(container_id, 0, 9, True)
            except TtrpcError:
                pass
        os.sync()
        asyncio.get_running_loop().call_later(0.05, libc.power_off)
        return Empty()




def _freeze(container_id: str, frozen: bool) -> None:
    with open(os.path.join(holder.cgroup_dir(container_id), "cgroup.freeze"), "w") as f:
        f.write("1" if frozen else "0")
