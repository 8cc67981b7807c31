"""The fake guest's agent (testbed/fakeguest.py): podvm.agent.v1.Agent served as the real
one (guest/agent/service.py) answers it, well-behaved, each container's processes run as
plain children of the fake guest on the host (testbed/fakeprocs.py):

- stdio goes through pipes or a pty that the agent's stream calls read and write;
- pause and resume are SIGSTOP and SIGCONT to the container's process groups, `all`
  signals reach every group of the container, Remove kills what is left; ListPids and
  ContainerStats read the groups' processes (their memory limit is the one the spec or
  UpdateContainer gave);
- ConfigureNetwork, Resume and a pod's hostname and sysctls are recorded and accepted,
  nothing of them is applied; OnlineCPUMem onlines what the fake VM has (testbed/
  fakeguest.py's Guest); GetOOMEvent waits for an OOM a test names over QMP
  (x-fake-oom); a port forward is refused (UNAVAILABLE: nothing listens in the pod);
  Shutdown kills everything and powers the fake guest off."""
from __future__ import annotations

import asyncio
import fcntl
import json
import os
import signal
import struct
import termios
import time
from typing import Protocol

from google.protobuf.any_pb2 import Any
from google.protobuf.empty_pb2 import Empty

from podvm_core.pb.agent import agent_pb2 as pb
from podvm_core.pb.containerd.cgroups.v2 import metrics_pb2 as m
from podvm_core.procstate import finished
from podvm_core.ttrpc import Code, Context, TtrpcError

from .fakeprocs import GUEST_SHARED, Box, Proc, check_program, memory_limit, spawn



class Guest(Protocol):
    """What the agent reads and sets of the fake guest's hardware (fakeguest.py's Guest,
    which imports this module: named here by what it offers, not imported)."""
    vcpus: dict[int, int]
    online_cpus: int
    memory_bytes: int
    oom: asyncio.Queue[str]


class FakeAgent:
    def __init__(self, guest: Guest, power_off: asyncio.Event, shared_dir: str) -> None:
        self.guest = guest
        self.shared_dir = shared_dir
        """The host directory the guest's GUEST_SHARED is (VMSpec.shared_dir)."""
        self.containers: dict[str, Box] = {}
        self.network: pb.ConfigureNetworkRequest | None = None
        self.resumed: pb.ResumeRequest | None = None
        self.pod: Proc | None = None
        self._power_off = power_off
        self._memory = guest.memory_mib << 20
        """What the guest has online (hot-plugged memory comes online at OnlineCPUMem)."""
        self._started = time.monotonic()

    def _box(self, container_id: str) -> Box:
        box = self.containers.get(container_id)
        if box is None:
            raise TtrpcError(Code.NOT_FOUND, f"container {container_id!r} not found in the guest")
        return box

    def kill_everything(self) -> None:
        for box in self.containers.values():
            box.signal_groups(signal.SIGKILL)
            for proc in (box.init, *box.execs.values()):
                proc.close()
        if self.pod is not None and self.pod.popen is not None:
            self.pod.popen.kill()

    async def Ping(self, req: pb.PingRequest, ctx: Context) -> pb.PingResponse:
        return pb.PingResponse(agent_version="fake", kernel_release="fake",
                               online_cpus=self.guest.online_cpus,
                               memory_total_bytes=self._memory,
                               uptime_seconds=time.monotonic() - self._started)

    async def Resume(self, req: pb.ResumeRequest, ctx: Context) -> Empty:
        self.resumed = req
        return Empty()

    async def ConfigureNetwork(self, req: pb.ConfigureNetworkRequest, ctx: Context) -> Empty:
        self.network = req
        return Empty()

    async def CreatePodNamespaces(self, req: pb.CreatePodNamespacesRequest,
                                  ctx: Context) -> pb.CreatePodNamespacesResponse:
        if self.pod is None or self.pod.exited.is_set():
            self.pod = Proc("pod")
            spawn(self.pod, [], [], None, gated=False)
        return pb.CreatePodNamespacesResponse(pid=self.pod.pid)

    async def OnlineCPUMem(self, req: pb.OnlineCPUMemRequest,
                           ctx: Context) -> pb.OnlineCPUMemResponse:
        present = len(self.guest.vcpus)
        self.guest.online_cpus = min(req.cpus, present) if req.cpus else present
        self._memory = self.guest.memory_bytes
        return pb.OnlineCPUMemResponse(online_cpus=self.guest.online_cpus,
                                       memory_total_bytes=self._memory)

    async def GrowScratch(self, req: pb.GrowScratchRequest,
                          ctx: Context) -> pb.GrowScratchResponse:
        """A fake VM has no scratch disk to grow: the size asked for, as a grown one."""
        return pb.GrowScratchResponse(filesystem_bytes=req.size_bytes)

    async def GetOOMEvent(self, req: pb.GetOOMEventRequest, ctx: Context) -> pb.OOMEvent:
        return pb.OOMEvent(container_id=await self.guest.oom.get())

    async def Shutdown(self, req: pb.ShutdownRequest, ctx: Context) -> Empty:
        self.kill_everything()
        asyncio.get_running_loop().call_later(0.05, self._power_off.set)
        return Empty()

    async def CreateContainer(self, req: pb.CreateContainerRequest,
                              ctx: Context) -> pb.CreateContainerResponse:
        if req.container_id in self.containers:
            raise TtrpcError(Code.ALREADY_EXISTS, f"container {req.container_id} exists")
        try:
            spec = json.loads(req.spec_json)
        except ValueError as exc:
            raise TtrpcError(Code.INVALID_ARGUMENT, f"spec is not JSON: {exc}") from None
        process = spec.get("process") or {}
        init = Proc(req.container_id)
        box = Box(req.container_id, req.sandbox, init, holder=req.pod_holder)
        box.root = self._host_path(req.rootfs_lower or (spec.get("root") or {}).get("path", ""))
        box.memory_limit = memory_limit((spec.get("linux") or {}).get("resources"))
        args = [] if req.pod_holder else process.get("args") or []
        env = process.get("env") or []
        if not req.pod_holder:
            check_program(args, env, box.root, init.name)
        spawn(init, args, env, req.stdio, gated=bool(args))
        self.containers[req.container_id] = box
        return pb.CreateContainerResponse(pid=init.pid)

    def _host_path(self, guest_path: str) -> str:
        if guest_path == GUEST_SHARED or guest_path.startswith(GUEST_SHARED + "/"):
            return self.shared_dir + guest_path[len(GUEST_SHARED):]
        return ""

    async def StartContainer(self, req: pb.StartContainerRequest,
                             ctx: Context) -> pb.StartContainerResponse:
        box = self._box(req.container_id)
        async with box.init.acting("start"):
            if not box.holder:
                box.init.open_gate()
        return pb.StartContainerResponse(pid=box.init.pid)

    async def ExecProcess(self, req: pb.ExecProcessRequest,
                          ctx: Context) -> pb.ExecProcessResponse:
        box = self._box(req.container_id)
        try:
            process = json.loads(req.process_json)
        except ValueError as exc:
            raise TtrpcError(Code.INVALID_ARGUMENT, f"process is not JSON: {exc}") from None
        async with box.init.acting("exec"):
            if req.exec_id in box.execs:
                raise TtrpcError(Code.ALREADY_EXISTS, f"exec {req.exec_id} exists")
            proc = Proc(req.container_id, req.exec_id)
            args, env = process.get("args") or [], process.get("env") or []
            check_program(args, env, box.root, proc.name)
            async with proc.acting("start"):
                spawn(proc, args, env, req.stdio, gated=False)
            box.execs[req.exec_id] = proc
        return pb.ExecProcessResponse(pid=proc.pid)

    async def SignalProcess(self, req: pb.SignalProcessRequest, ctx: Context) -> Empty:
        box = self._box(req.container_id)
        proc = box.process(req.exec_id)
        every = req.all and not req.exec_id and not box.holder
        async with proc.acting("kill_all" if every else "kill"):
            if every:
                if not box.signal_groups(req.signal):
                    raise finished(proc.name, proc.state)
            else:
                if proc.exited.is_set():
                    raise finished(proc.name, proc.state)
                try:
                    os.kill(proc.pid, req.signal)
                except ProcessLookupError:
                    raise finished(proc.name, proc.state) from None
        return Empty()

    async def WaitProcess(self, req: pb.WaitProcessRequest,
                          ctx: Context) -> pb.WaitProcessResponse:
        proc = self._box(req.container_id).process(req.exec_id)
        await proc.exited.wait()
        response = pb.WaitProcessResponse(exit_status=proc.exit_status)
        response.exited_at.FromNanoseconds(proc.exited_at_ns)
        return response

    def _pids(self, box: Box) -> list[int]:
        """The live processes of the container's groups (its init's and execs')."""
        groups, found = set(box.groups()), []
        for entry in os.listdir("/proc"):
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if fields[0] != "Z" and int(fields[2]) in groups:
                found.append(int(entry))
        return sorted(found)

    async def ListPids(self, req: pb.ListPidsRequest, ctx: Context) -> pb.ListPidsResponse:
        box = self._box(req.container_id)
        execs = {p.pid: e for e, p in box.execs.items()}
        return pb.ListPidsResponse(processes=[pb.ProcessEntry(pid=pid, exec_id=execs.get(pid, ""))
                                              for pid in self._pids(box)])

    async def ContainerStats(self, req: pb.ContainerStatsRequest,
                             ctx: Context) -> pb.ContainerStatsResponse:
        pids, ticks = self._pids(self._box(req.container_id)), os.sysconf("SC_CLK_TCK")
        usage = cpu = 0
        for pid in pids:
            try:
                with open(f"/proc/{pid}/statm") as f:
                    usage += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                cpu += (int(fields[11]) + int(fields[12])) * 1_000_000 // ticks
            except (OSError, IndexError, ValueError):
                pass
        limit = self._box(req.container_id).memory_limit
        metrics = m.Metrics(pids=m.PidsStat(current=len(pids)), cpu=m.CPUStat(usage_usec=cpu),
                            memory=m.MemoryStat(usage=usage, usage_limit=limit))
        return pb.ContainerStatsResponse(metrics=Any(type_url=m.Metrics.DESCRIPTOR.full_name,
                                                     value=metrics.SerializeToString()))

    async def UpdateContainer(self, req: pb.UpdateContainerRequest, ctx: Context) -> Empty:
        box = self._box(req.container_id)
        async with box.init.acting("update"):
            try:
                resources = json.loads(req.resources_json)
            except ValueError as exc:
                raise TtrpcError(Code.INVALID_ARGUMENT, f"resources are not JSON: {exc}") \
                    from None
            box.memory_limit = memory_limit(resources) or box.memory_limit
        return Empty()

    async def _freeze(self, req_id: str, operation: str, signum: int) -> Empty:
        box = self._box(req_id)
        async with box.init.acting(operation):
            box.signal_groups(signum)
        return Empty()

    async def PauseContainer(self, req: pb.PauseContainerRequest, ctx: Context) -> Empty:
        return await self._freeze(req.container_id, "pause", signal.SIGSTOP)

    async def ResumeContainer(self, req: pb.ResumeContainerRequest, ctx: Context) -> Empty:
        return await self._freeze(req.container_id, "resume", signal.SIGCONT)

    async def RemoveContainer(self, req: pb.RemoveContainerRequest, ctx: Context) -> Empty:
        box = self._box(req.container_id)
        async with box.init.acting("delete"):
            if not box.init.exited.is_set():  # runc delete --force
                box.signal_groups(signal.SIGKILL)
                box.signal_groups(signal.SIGCONT)
                await box.init.exited.wait()
            for proc in (box.init, *box.execs.values()):
                proc.close()
            del self.containers[req.container_id]
        return Empty()

    async def RemoveProcess(self, req: pb.RemoveProcessRequest, ctx: Context) -> Empty:
        if not req.exec_id:
            raise TtrpcError(Code.INVALID_ARGUMENT, f"container {req.container_id}: no exec "
                                                    f"id (an init goes with its container)")
        box = self._box(req.container_id)
        proc = box.process(req.exec_id)
        async with proc.acting("delete"):
            proc.close()
            del box.execs[req.exec_id]
        return Empty()

    async def _read(self, req: pb.ReadStreamRequest, name: str) -> pb.ReadStreamResponse:
        stream = self._box(req.container_id).process(req.exec_id).stream(name)
        if stream is None:
            return pb.ReadStreamResponse()
        return pb.ReadStreamResponse(data=await stream.read(req.max_bytes or 65536))

    async def ReadStdout(self, req: pb.ReadStreamRequest, ctx: Context) -> pb.ReadStreamResponse:
        return await self._read(req, "stdout")

    async def ReadStderr(self, req: pb.ReadStreamRequest, ctx: Context) -> pb.ReadStreamResponse:
        return await self._read(req, "stderr")

    async def WriteStdin(self, req: pb.WriteStreamRequest,
                         ctx: Context) -> pb.WriteStreamResponse:
        stream = self._box(req.container_id).process(req.exec_id).stream("stdin")
        if stream is None or stream.fd < 0:
            raise TtrpcError(Code.FAILED_PRECONDITION, "the process has no open stdin")
        return pb.WriteStreamResponse(written=await stream.write(req.data))

    async def CloseStdin(self, req: pb.CloseStdinRequest, ctx: Context) -> Empty:
        proc = self._box(req.container_id).process(req.exec_id)
        if proc.pty is None and proc.stdin is not None:
            proc.stdin.close()
        elif proc.pty is not None:
            await proc.pty.write(b"\x04")  # end of file on a terminal
        return Empty()

    async def ResizeTty(self, req: pb.ResizeTtyRequest, ctx: Context) -> Empty:
        proc = self._box(req.container_id).process(req.exec_id)
        if proc.pty is None:
            raise TtrpcError(Code.FAILED_PRECONDITION, "the process has no terminal")
        fcntl.ioctl(proc.pty.fd, termios.TIOCSWINSZ,
                    struct.pack("HHHH", req.height, req.width, 0, 0))
        return Empty()

    async def OpenPortForward(self, req: pb.OpenPortForwardRequest,
                              ctx: Context) -> pb.OpenPortForwardResponse:
        raise TtrpcError(Code.UNAVAILABLE, f"nothing listens on port {req.port} in the pod "
                                           f"(a fake guest forwards no port)")

    async def _no_stream(self, stream_id: int) -> None:
        raise TtrpcError(Code.NOT_FOUND, f"no port-forward stream {stream_id}")

    async def ReadPortForward(self, req: pb.ReadPortForwardRequest,
                              ctx: Context) -> pb.ReadStreamResponse:
        await self._no_stream(req.stream_id)
        return pb.ReadStreamResponse()

    async def WritePortForward(self, req: pb.WritePortForwardRequest,
                               ctx: Context) -> pb.WriteStreamResponse:
        await self._no_stream(req.stream_id)
        return pb.WriteStreamResponse()

    async def ClosePortForward(self, req: pb.ClosePortForwardRequest, ctx: Context) -> Empty:
        await self._no_stream(req.stream_id)
        return Empty()
