"""The host side of the guest agent: typed calls over ttrpc on the VM's virtio-serial
socket. A lost connection means the guest (or QEMU) is gone: UNAVAILABLE.

The guest is not trusted (its root may be a container that broke out): every call has a
deadline, so a guest that never answers holds no containerd call longer than its bound,
and the other calls go on meanwhile (the ttrpc client multiplexes one connection). A
missed deadline is DEADLINE_EXCEEDED naming the call and the sandbox. The long polls
(WaitProcess, GetOOMEvent, the stream reads) are asked in windows of POLL seconds, again
when one ends with nothing to say (guest/agent/service.py's handlers wait, then take
what they answer: a window that ends loses nothing); only background tasks make them.
What the guest answers is checked where the shim passes it on: stats are containerd's
cgroup v2 Metrics, bounded in size; a guest's error message is cut to _MESSAGE_MAX."""
from __future__ import annotations

import asyncio
import contextlib
import os
import time
from typing import TYPE_CHECKING, TypeVar

from google.protobuf.any_pb2 import Any
from google.protobuf.empty_pb2 import Empty
from google.protobuf.message import DecodeError, Message

from podvm_core.pb.agent import agent_pb2 as pb
from podvm_core.pb.containerd.cgroups.v2.metrics_pb2 import Metrics
from podvm_core.protocol import AGENT_SERVICE
from podvm_core.ttrpc import Client, Code, ConnectionClosed, TtrpcError

from .guestclock import GuestClock
from .stdio import Stdio

if TYPE_CHECKING:
    from collections.abc import Sequence

    from ..host.emptydir import LocalDir
    from .hypervisor import VM
    from ..network.model import PodNetwork

R = TypeVar("R", bound=Message)

# Deadlines of the agent's calls (seconds), by what the agent does to answer.
QUICK = 10.0
"""From its own state or a few files: Ping, ContainerStats, CloseStdin, ResizeTty,
RemoveProcess, ClosePortForward."""
RUNC = 30.0
"""One runc command (ps, kill, update, pause, resume, delete): ~0.3 s under TCG, more on
a loaded node. ListPids, SignalProcess, UpdateContainer, Pause/Resume, RemoveContainer."""
SETUP = 120.0
"""A container or exec set up in the guest (runc create/start/exec, mounts, hooks, the
pod's namespaces): generous, finite."""
GUEST = 30.0
"""The guest's own resources: OnlineCPUMem (waits up to 10 s in the guest),
ConfigureNetwork, OpenPortForward."""
FLOW = 300.0
"""A write the guest answers once its reader took the bytes (stdin, a port forward): a
reader that takes nothing for this long ends the copy."""
POLL = 60.0
"""A long poll's window (WaitProcess, GetOOMEvent, stream reads)."""
POLL_GRACE = 30.0
"""How long past a window the host still waits for the agent's answer: a result the
agent made just before the window ended must not be lost to a busy guest."""
POLL_PACE = 1.0
"""A window that ends sooner than this is asked again only this much later: a guest
answering DEADLINE_EXCEEDED at once cannot make the shim spin."""
SHUTDOWN = 5.0
STATS_MAX_BYTES = 64 << 10
"""The most a container's Metrics may take: every field set with 40-bit values is 497
bytes, each I/O device ~35 more; room for a thousand devices, not a guest's 4 MiB."""
_MESSAGE_MAX = 2048
"""Chars of a guest's error message passed on to containerd."""


class Agent:
    def __init__(self, client: Client, sandbox_id: str) -> None:
        self._client = client
        self._sandbox_id = sandbox_id
        self.clock = GuestClock()
        """How long the host has waited for this guest's answers (the polls and flows
        not counted)."""

    @classmethod
    def of_vm(cls, vm: "VM") -> "Agent":
        """Over the connection the VM made to the agent's port before its guest ran."""
        return cls(Client(*vm.take_agent_stream()), vm.spec.sandbox_id)

    @property
    def lost(self) -> bool:
        """The connection to the agent is gone: the VM died, or is dying."""
        return self._client.closed

    async def close(self) -> None:
        await self._client.close()

    async def _call(self, method: str, request: Message, response: type[R],
                    timeout: float, grace: float = 1.0, timed: bool = True) -> R:
        """`timed`: the wait is the guest's (the clock's), not a poll's or a flow's."""
        try:
            with self.clock.waiting() if timed else contextlib.nullcontext():
                return await self._client.call(AGENT_SERVICE, method, request, response,
                                               timeout=timeout, grace=grace)
        except ConnectionClosed as exc:
            raise TtrpcError(Code.UNAVAILABLE, f"the guest agent of sandbox {self._sandbox_id} "
                                               f"is gone ({exc}): did the VM die?") from None
        except TtrpcError as exc:
            if exc.code == Code.DEADLINE_EXCEEDED:
                raise TtrpcError(Code.DEADLINE_EXCEEDED,
                                 f"the guest agent of sandbox {self._sandbox_id} did not "
                                 f"answer {method} within {timeout:g}s") from None
            if len(exc.message) > _MESSAGE_MAX:
                raise TtrpcError(exc.code, exc.message[:_MESSAGE_MAX] + "...") from None
            raise

    async def _poll(self, method: str, request: Message, response: type[R]) -> R:
        """A long poll: asked again each time a window ends with nothing to say."""
        while True:
            started = time.monotonic()
            try:
                return await self._call(method, request, response, POLL, POLL_GRACE,
                                        timed=False)
            except TtrpcError as exc:
                if exc.code != Code.DEADLINE_EXCEEDED:
                    raise
            if time.monotonic() - started < POLL_PACE:
                await asyncio.sleep(POLL_PACE)

    async def ping(self, timeout: float = QUICK) -> pb.PingResponse:
        return await self._call("Ping", pb.PingRequest(), pb.PingResponse, timeout)

    async def resume_restored(self, macs: dict[str, str], timeout: float = SETUP) -> None:
        """A guest restored from a template made this pod's (first call): the host's
        clock, fresh entropy for its CRNG, `macs` (template MAC -> the pod's) on its
        NICs, the pod's share mounted."""
        req = pb.ResumeRequest(realtime_unix_nanos=time.time_ns(), entropy=os.urandom(64),
                               macs=[pb.MacChange(template_mac=t, mac=m)
                                     for t, m in macs.items()])
        await self._call("Resume", req, Empty, timeout)

    async def create_container(self, container_id: str, spec_json: bytes, stdio: Stdio,
                               sandbox: bool, pod_holder: bool = False,
                               rootfs_lower: str = "",
                               local_dirs: Sequence[LocalDir] = ()) -> int:
        req = pb.CreateContainerRequest(
            container_id=container_id, spec_json=spec_json, stdio=stdio.message(),
            sandbox=sandbox, sandbox_id=self._sandbox_id, pod_holder=pod_holder,
            rootfs_lower=rootfs_lower,
            local_dirs=[pb.LocalDir(path=d.path, mode=d.mode, uid=d.uid, gid=d.gid)
                        for d in local_dirs])
        return (await self._call("CreateContainer", req, pb.CreateContainerResponse,
                                 SETUP)).pid

    async def start_container(self, container_id: str) -> int:
        return (await self._call("StartContainer", pb.StartContainerRequest(
            container_id=container_id), pb.StartContainerResponse, SETUP)).pid

    async def exec_process(self, container_id: str, exec_id: str, process_json: bytes,
                           stdio: Stdio) -> int:
        req = pb.ExecProcessRequest(container_id=container_id, exec_id=exec_id,
                                    process_json=process_json, stdio=stdio.message())
        return (await self._call("ExecProcess", req, pb.ExecProcessResponse, SETUP)).pid

    async def signal(self, container_id: str, exec_id: str, signal: int, all_: bool) -> None:
        await self._call("SignalProcess", pb.SignalProcessRequest(
            container_id=container_id, exec_id=exec_id, signal=signal, all=all_), Empty,
            RUNC)

    async def wait(self, container_id: str, exec_id: str) -> pb.WaitProcessResponse:
        """A long poll (POLL): for a background task, never a containerd call."""
        return await self._poll("WaitProcess", pb.WaitProcessRequest(
            container_id=container_id, exec_id=exec_id), pb.WaitProcessResponse)

    async def pids(self, container_id: str) -> list[pb.ProcessEntry]:
        return list((await self._call("ListPids", pb.ListPidsRequest(
            container_id=container_id), pb.ListPidsResponse, RUNC)).processes)

    async def stats(self, container_id: str) -> Any:
        """The container's cgroup v2 Metrics in an Any, as containerd takes them; what the
        guest sent is decoded as that type and packed anew (nothing else of it passes),
        and is at most STATS_MAX_BYTES. Anything else: INTERNAL, nothing forwarded."""
        response = await self._call("ContainerStats", pb.ContainerStatsRequest(
            container_id=container_id), pb.ContainerStatsResponse, QUICK)
        return checked_metrics(response.metrics, f"sandbox {self._sandbox_id}, container "
                                                 f"{container_id}")

    async def update(self, container_id: str, resources_json: bytes) -> None:
        await self._call("UpdateContainer", pb.UpdateContainerRequest(
            container_id=container_id, resources_json=resources_json), Empty, RUNC)

    async def pause(self, container_id: str) -> None:
        await self._call("PauseContainer", pb.PauseContainerRequest(
            container_id=container_id), Empty, RUNC)

    async def resume(self, container_id: str) -> None:
        await self._call("ResumeContainer", pb.ResumeContainerRequest(
            container_id=container_id), Empty, RUNC)

    async def remove(self, container_id: str) -> None:
        await self._call("RemoveContainer", pb.RemoveContainerRequest(
            container_id=container_id), Empty, RUNC)

    async def remove_process(self, container_id: str, exec_id: str,
                             timeout: float = QUICK) -> None:
        """Bounded: an exec's Delete must not hang on a guest that no longer answers."""
        await self._call("RemoveProcess", pb.RemoveProcessRequest(
            container_id=container_id, exec_id=exec_id), Empty, timeout)

    async def read(self, stream: str, container_id: str, exec_id: str,
                   max_bytes: int = 65536) -> bytes:
        """A long poll (POLL)."""
        method = "ReadStdout" if stream == "stdout" else "ReadStderr"
        return (await self._poll(method, pb.ReadStreamRequest(
            container_id=container_id, exec_id=exec_id, max_bytes=max_bytes),
            pb.ReadStreamResponse)).data

    async def write_stdin(self, container_id: str, exec_id: str, data: bytes) -> int:
        return (await self._call("WriteStdin", pb.WriteStreamRequest(
            container_id=container_id, exec_id=exec_id, data=data),
            pb.WriteStreamResponse, FLOW, timed=False)).written

    async def close_stdin(self, container_id: str, exec_id: str) -> None:
        await self._call("CloseStdin", pb.CloseStdinRequest(
            container_id=container_id, exec_id=exec_id), Empty, QUICK)

    async def resize(self, container_id: str, exec_id: str, width: int, height: int) -> None:
        await self._call("ResizeTty", pb.ResizeTtyRequest(
            container_id=container_id, exec_id=exec_id, width=width, height=height), Empty,
            QUICK)

    async def open_port_forward(self, port: int) -> int:
        """A connection from the guest to `port` on the pod's loopback: its stream id.
        UNAVAILABLE when nothing in the pod listens there."""
        return (await self._call("OpenPortForward", pb.OpenPortForwardRequest(port=port),
                                 pb.OpenPortForwardResponse, GUEST)).stream_id

    async def read_port_forward(self, stream_id: int, max_bytes: int = 65536) -> bytes:
        """What the guest's side sent next; b"" once it has ended."""
        return (await self._poll("ReadPortForward", pb.ReadPortForwardRequest(
            stream_id=stream_id, max_bytes=max_bytes), pb.ReadStreamResponse)).data

    async def write_port_forward(self, stream_id: int, data: bytes) -> None:
        await self._call("WritePortForward", pb.WritePortForwardRequest(
            stream_id=stream_id, data=data), pb.WriteStreamResponse, FLOW, timed=False)

    async def close_port_forward(self, stream_id: int, write_only: bool = False) -> None:
        await self._call("ClosePortForward", pb.ClosePortForwardRequest(
            stream_id=stream_id, write_only=write_only), Empty, QUICK)

    async def online(self, cpus: int = 0, wait_memory_bytes: int = 0
                     ) -> pb.OnlineCPUMemResponse:
        """Bring hot-plugged memory online in the guest, and CPUs: exactly `cpus` of
        them (0: all present); waits (up to 10 s in the guest) until that many are
        online and MemTotal reaches `wait_memory_bytes`."""
        return await self._call("OnlineCPUMem", pb.OnlineCPUMemRequest(
            wait_cpus=cpus, cpus=cpus, wait_memory_bytes=wait_memory_bytes),
            pb.OnlineCPUMemResponse, GUEST)

    async def grow_scratch(self, size_bytes: int) -> int:
        """The scratch file system grown to the disk's new size; its size now."""
        return (await self._call("GrowScratch", pb.GrowScratchRequest(size_bytes=size_bytes),
                                 pb.GrowScratchResponse, GUEST)).filesystem_bytes

    async def create_pod_namespaces(self, hostname: str = "",
                                    sysctls: dict[str, str] | None = None) -> int:
        """The pod's pid, ipc and uts namespaces, `hostname` set in the last ("": the
        guest's own), the pod's `sysctls` set in them."""
        return (await self._call("CreatePodNamespaces", pb.CreatePodNamespacesRequest(
            hostname=hostname, sysctls=sysctls or {}), pb.CreatePodNamespacesResponse,
            SETUP)).pid

    async def configure_network(self, network: "PodNetwork", timeout: float = GUEST) -> None:
        """The guest's interfaces made the pod's: found by MAC, named, sized, addressed
        and routed as CNI left them in the pod's namespace. The routes the kernel makes
        for an address are left out: the guest's kernel makes them too."""
        await self._call("ConfigureNetwork", network_request(network), Empty, timeout)

    async def oom_event(self) -> str:
        """A long poll (POLL): the id is the guest's word, to be checked by the caller."""
        return (await self._poll("GetOOMEvent", pb.GetOOMEventRequest(),
                                 pb.OOMEvent)).container_id

    async def shutdown(self, timeout: float = SHUTDOWN) -> None:
        await self._call("Shutdown", pb.ShutdownRequest(), Empty, timeout)


def checked_metrics(metrics: Any, whose: str) -> Any:
    """`metrics` (the guest's) as containerd's cgroup v2 Metrics, decoded and packed anew
    without the fields the type does not have; TtrpcError INTERNAL when they are not."""
    name = Metrics.DESCRIPTOR.full_name
    size = metrics.ByteSize()
    if size > STATS_MAX_BYTES:
        raise TtrpcError(Code.INTERNAL, f"{whose}: the guest sent stats of {size} bytes, "
                                        f"more than the {STATS_MAX_BYTES} allowed")
    if metrics.type_url != name:
        raise TtrpcError(Code.INTERNAL, f"{whose}: the guest sent stats of type "
                                        f"{metrics.type_url[:200]!r}, not {name}")
    try:
        decoded = Metrics.FromString(metrics.value)
    except DecodeError as exc:
        raise TtrpcError(Code.INTERNAL, f"{whose}: the guest sent stats that do not decode "
                                        f"as {name}: {exc}") from None
    decoded.DiscardUnknownFields()
    return Any(type_url=name, value=decoded.SerializeToString())


def network_request(network: "PodNetwork") -> pb.ConfigureNetworkRequest:
    """The pod's network as the agent takes it, without the routes of protocol "kernel"
    (an address's own prefix route: the guest's kernel makes it when the address is
    added, and `ip route replace` would only duplicate it with another protocol)."""
    return pb.ConfigureNetworkRequest(
        interfaces=[pb.NetworkInterface(
            name=itf.name, mac=itf.mac, mtu=itf.mtu,
            addresses=[pb.IPAddress(address=a.address, prefix_len=a.prefix_len)
                       for a in itf.addresses]) for itf in network.interfaces],
        routes=[pb.NetworkRoute(destination=r.destination, gateway=r.gateway or "",
                                device=r.device, scope=r.scope, source=r.source or "",
                                metric=r.metric or 0)
                for r in network.routes if r.protocol != "kernel"])
