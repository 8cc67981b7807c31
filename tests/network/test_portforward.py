"""CRI PortForward without a VM: containerd's side is a client that dials 127.0.0.1:PORT
inside a real network namespace, as containerd does; the guest is the real agent service
(guest/agent) behind a real ttrpc connection, serving from this process's own namespace,
where the test's "pod servers" listen on 127.0.0.1 only. So a byte that arrives went
through the nat rule, the shim's listener, SO_ORIGINAL_DST, the agent's RPCs and back."""
from __future__ import annotations

import asyncio
import hashlib
import os
import socket
import subprocess
from typing import AsyncIterator, Awaitable, Callable

import pytest

from guest.agent.service import AgentService
from podvm_core.pb.agent import agent_pb2
from podvm_core.ttrpc import Client, Server, bind
from shim.vm.agent import Agent
from shim.network.enter import made_inside
from shim.network.portforward import LISTEN_ADDRESS, PortForwarder
from testbed.prereqs import require_tool
from tests.network.conftest import Namespace

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@pytest.fixture
async def agent() -> AsyncIterator[tuple[Agent, AgentService]]:
    """The shim's Agent client and the guest's AgentService, over a socketpair."""
    service = AgentService()
    server = Server([bind(agent_pb2.DESCRIPTOR.services_by_name["Agent"], service)])
    host_end, guest_end = socket.socketpair()
    guest_reader, guest_writer = await asyncio.open_connection(sock=guest_end)
    serving = asyncio.create_task(server.serve_stream(guest_reader, guest_writer))
    host_reader, host_writer = await asyncio.open_connection(sock=host_end)
    client = Agent(Client(host_reader, host_writer), "pf-test")
    yield client, service
    await client.close()
    serving.cancel()
    await asyncio.gather(serving, return_exceptions=True)


@pytest.fixture
async def pod_ns(peer: Namespace) -> Namespace:
    require_tool("iptables", "iptables")
    require_tool("nsenter", "util-linux")
    peer.ip("link", "set", "lo", "up")
    return peer


@pytest.fixture
async def forwarder(pod_ns: Namespace, agent) -> AsyncIterator[PortForwarder]:
    fwd = PortForwarder("pf-test", pod_ns.path, agent[0])
    await fwd.start()
    yield fwd
    await fwd.stop()


async def guest_server(handler: Handler, host: str = "127.0.0.1") -> tuple[asyncio.Server, int]:
    server = await asyncio.start_server(handler, host, 0)
    return server, server.sockets[0].getsockname()[1]


async def dial(ns: Namespace, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """containerd's net.Dial("tcp4", "localhost:PORT") inside the pod's namespace."""
    sock = made_inside(ns.path, lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM))
    sock.setblocking(False)
    await asyncio.wait_for(asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port)), 5)
    return await asyncio.open_connection(sock=sock)


async def greet(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Reads to the end, then answers: also shows that a half-close reaches the guest."""
    data = await reader.read()
    writer.write(b"hello " + data)
    await writer.drain()
    writer.close()


def nat_rules(ns: Namespace) -> str:
    return subprocess.run(["ip", "netns", "exec", ns.name, "iptables", "-w", "-t", "nat", "-S",
                           "OUTPUT"], capture_output=True, text=True, check=True).stdout


async def test_a_connection_to_localhost_in_the_pod_reaches_the_guest_port(
        pod_ns: Namespace, forwarder: PortForwarder) -> None:
    server, port = await guest_server(greet)
    async with server:
        for name in (b"first", b"second"):  # a fresh connection each time
            reader, writer = await dial(pod_ns, port)
            writer.write(name)
            writer.write_eof()  # half-close: the answer still comes back
            assert await asyncio.wait_for(reader.read(), 10) == b"hello " + name
            writer.close()
    assert "127.0.0.2:1" in nat_rules(pod_ns)


async def test_a_port_nobody_listens_on_resets_the_connection(
        pod_ns: Namespace, forwarder: PortForwarder) -> None:
    server, port = await guest_server(greet)
    server.close()
    await server.wait_closed()  # a port that was free a moment ago: nobody listens now
    reader, writer = await dial(pod_ns, port)
    with pytest.raises(ConnectionResetError):
        await asyncio.wait_for(reader.read(), 10)
    writer.close()


async def test_many_connections_at_once_each_get_their_own_bytes(
        pod_ns: Namespace, forwarder: PortForwarder, agent) -> None:
    server, port = await guest_server(greet)

    async def one(i: int) -> bytes:
        reader, writer = await dial(pod_ns, port)
        writer.write(str(i).encode() * 1000)
        writer.write_eof()
        try:
            return await asyncio.wait_for(reader.read(), 30)
        finally:
            writer.close()

    async with server:
        answers = await asyncio.gather(*(one(i) for i in range(24)))
    assert answers == [b"hello " + str(i).encode() * 1000 for i in range(24)]
    for _ in range(100):  # every stream is forgotten in the guest once both ends closed
        if not len(agent[1]._port_forwards()):
            break
        await asyncio.sleep(0.05)
    assert len(agent[1]._port_forwards()) == 0


async def test_a_slow_reader_holds_the_sender_back_and_loses_nothing(
        pod_ns: Namespace, forwarder: PortForwarder) -> None:
    size = 48 << 20
    payload = os.urandom(1 << 20) * 48
    sent = asyncio.Event()

    async def flood(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(payload)
        await writer.drain()
        sent.set()
        writer.close()

    server, port = await guest_server(flood)
    async with server:
        reader, writer = await dial(pod_ns, port)
        await asyncio.sleep(3)  # the client reads nothing yet
        assert not sent.is_set(), "48 MiB were taken with nobody reading: buffered somewhere"
        digest, got = hashlib.sha256(), 0
        while chunk := await asyncio.wait_for(reader.read(1 << 20), 30):
            digest.update(chunk)
            got += len(chunk)
        writer.close()
    assert got == size and digest.digest() == hashlib.sha256(payload).digest()
    assert sent.is_set()


async def test_a_slow_guest_reader_holds_the_client_back_and_loses_nothing(
        pod_ns: Namespace, forwarder: PortForwarder) -> None:
    payload = os.urandom(1 << 20) * 48
    reading = asyncio.Event()
    got: list[bytes] = []

    async def sink(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reading.wait()
        got.append(await reader.read())
        writer.close()

    server, port = await guest_server(sink)
    async with server:
        reader, writer = await dial(pod_ns, port)
        writer.write(payload)
        with pytest.raises(asyncio.TimeoutError):  # nobody reads in the guest yet
            await asyncio.wait_for(asyncio.shield(writer.drain()), 3)
        reading.set()
        await asyncio.wait_for(writer.drain(), 60)
        writer.write_eof()
        await asyncio.wait_for(reader.read(), 30)  # the guest's end closes after reading
        writer.close()
    assert hashlib.sha256(b"".join(got)).digest() == hashlib.sha256(payload).digest()


async def test_stopping_ends_open_forwards_closes_the_listener_and_removes_the_rule(
        pod_ns: Namespace, agent) -> None:
    fwd = PortForwarder("pf-test", pod_ns.path, agent[0])
    await fwd.start()
    held = asyncio.Event()

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.set()
        await reader.read()  # until the forward goes
        writer.close()

    server, port = await guest_server(hold)
    async with server:
        reader, writer = await dial(pod_ns, port)
        await asyncio.wait_for(held.wait(), 10)
        await asyncio.wait_for(fwd.stop(), 10)
        with pytest.raises(ConnectionResetError):
            await asyncio.wait_for(reader.read(), 10)
        writer.close()
        await fwd.stop()  # idempotent
    assert "DNAT" not in nat_rules(pod_ns)
    with pytest.raises(ConnectionRefusedError):  # no rule, no listener: nothing answers
        await dial(pod_ns, port)
    probe = made_inside(pod_ns.path, lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM))
    with probe:
        probe.bind(LISTEN_ADDRESS)  # the listener's address is free again


async def test_a_server_on_ipv6_loopback_only_is_reached(
        pod_ns: Namespace, forwarder: PortForwarder) -> None:
    server, port = await guest_server(greet, host="::1")
    async with server:
        reader, writer = await dial(pod_ns, port)
        writer.write(b"six")
        writer.write_eof()
        assert await asyncio.wait_for(reader.read(), 10) == b"hello six"
        writer.close()
