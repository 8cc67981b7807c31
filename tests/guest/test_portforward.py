"""The guest's end of a port forward (guest/agent/portforward.py) with real sockets on
this machine's loopback: what the shim is told for a port nobody listens on, a stream it
does not know, a half-close, and that a closed stream is forgotten."""
from __future__ import annotations

import asyncio

import pytest

from guest.agent.portforward import PortForwards
from podvm_core.ttrpc import Code, TtrpcError


async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.write(b"got " + await reader.read())
    await writer.drain()
    writer.close()


async def test_bytes_go_both_ways_and_a_half_close_reaches_the_server() -> None:
    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    forwards = PortForwards()
    async with server:
        stream_id, address = await forwards.open(port)
        assert address == "127.0.0.1"
        assert await forwards.write(stream_id, b"abc") == 3
        forwards.close(stream_id, write_only=True)
        forwards.close(stream_id, write_only=True)  # idempotent
        received = b""
        while data := await asyncio.wait_for(forwards.read(stream_id, 2), 10):
            received += data  # at most max_bytes at a time
            assert len(data) <= 2
        assert received == b"got abc"
        forwards.close(stream_id, write_only=False)
        assert len(forwards) == 0
        forwards.close(stream_id, write_only=False)  # a closed one: nothing to do
        with pytest.raises(TtrpcError) as gone:
            await forwards.read(stream_id, 10)
        assert gone.value.code == Code.NOT_FOUND


async def test_a_port_nobody_listens_on_is_unavailable_and_says_what_was_tried() -> None:
    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    forwards = PortForwards()
    with pytest.raises(TtrpcError) as refused:
        await forwards.open(port)
    assert refused.value.code == Code.UNAVAILABLE
    assert f"port {port}" in refused.value.message
    assert "127.0.0.1" in refused.value.message and "::1" in refused.value.message
    assert len(forwards) == 0


@pytest.mark.parametrize("port", [0, 65536])
async def test_a_port_out_of_range_is_invalid(port: int) -> None:
    with pytest.raises(TtrpcError) as bad:
        await PortForwards().open(port)
    assert bad.value.code == Code.INVALID_ARGUMENT


async def test_writing_to_a_stream_whose_server_reset_is_unavailable() -> None:
    async def reset(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.transport.abort()

    server = await asyncio.start_server(reset, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    forwards = PortForwards()
    async with server:
        stream_id, _ = await forwards.open(port)
        assert await asyncio.wait_for(forwards.read(stream_id, 10), 10) == b""
        with pytest.raises(TtrpcError) as broken:
            for _ in range(100):  # the first writes may still be taken by the kernel
                await forwards.write(stream_id, b"x" * 65536)
                await asyncio.sleep(0.01)
        assert broken.value.code == Code.UNAVAILABLE
        forwards.close(stream_id, write_only=False)
