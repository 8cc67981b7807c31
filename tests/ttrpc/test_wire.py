"""The server against raw bytes: bad stream ids, oversized and garbage frames."""
from __future__ import annotations

import asyncio
import struct

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from podvm_core.pb.containerd.task.v2 import shim_pb2 as task
from podvm_core.pb.ttrpc_pb2 import Request, Response
from podvm_core.ttrpc import Client
from podvm_core.ttrpc.codes import Code
from podvm_core.ttrpc.framing import HEADER, MAX_DATA

from .conftest import SERVICE


def request_frame(stream_id: int, id_: str = "x", type_: int = 1) -> bytes:
    payload = Request(service=SERVICE, method="State",
                      payload=task.StateRequest(id=id_).SerializeToString()).SerializeToString()
    return HEADER.pack(len(payload), stream_id, type_, 0) + payload


async def read_response(reader: asyncio.StreamReader) -> tuple[int, Response]:
    length, stream_id, type_, _ = HEADER.unpack(await reader.readexactly(HEADER.size))
    assert type_ == 2
    return stream_id, Response.FromString(await reader.readexactly(length))


async def test_even_and_reused_stream_ids_are_invalid_argument(server, socket_path) -> None:
    reader, writer = await asyncio.open_unix_connection(socket_path)
    writer.write(request_frame(2))
    sid, resp = await read_response(reader)
    assert (sid, resp.status.code) == (2, Code.INVALID_ARGUMENT)
    writer.write(request_frame(5, "five"))
    sid, resp = await read_response(reader)
    assert sid == 5 and resp.status.code == Code.OK
    assert task.StateResponse.FromString(resp.payload).id == "five"
    for stale in (5, 3):
        writer.write(request_frame(stale))
        sid, resp = await read_response(reader)
        assert (sid, resp.status.code) == (stale, Code.INVALID_ARGUMENT)
        assert "re-used" in resp.status.message
    writer.write(request_frame(7, "seven"))
    sid, resp = await read_response(reader)
    assert (sid, resp.status.code) == (7, Code.OK)
    writer.close()


async def test_oversized_request_is_drained_and_connection_stays(server, socket_path) -> None:
    reader, writer = await asyncio.open_unix_connection(socket_path)
    size = MAX_DATA + 1
    writer.write(HEADER.pack(size, 1, 1, 0) + b"\0" * size)
    writer.write(request_frame(3, "after"))
    sid, resp = await read_response(reader)
    assert (sid, resp.status.code) == (1, Code.RESOURCE_EXHAUSTED)
    assert str(size) in resp.status.message
    sid, resp = await read_response(reader)
    assert sid == 3 and task.StateResponse.FromString(resp.payload).id == "after"
    writer.close()


async def test_unknown_frame_types_are_ignored(server, socket_path) -> None:
    reader, writer = await asyncio.open_unix_connection(socket_path)
    writer.write(HEADER.pack(3, 1, 0x7f, 0) + b"abc")
    writer.write(HEADER.pack(0, 1, 0x03, 0x04))  # a Data frame, no data
    writer.write(request_frame(3, "still"))
    sid, resp = await read_response(reader)
    assert sid == 3 and task.StateResponse.FromString(resp.payload).id == "still"
    writer.close()


async def test_garbage_envelope_is_invalid_argument(server, socket_path) -> None:
    reader, writer = await asyncio.open_unix_connection(socket_path)
    writer.write(HEADER.pack(4, 1, 1, 0) + b"\xff\xff\xff\xff")
    sid, resp = await read_response(reader)
    assert (sid, resp.status.code) == (1, Code.INVALID_ARGUMENT)
    writer.close()


async def _still_serves(socket_path: str) -> None:
    async with await Client.connect(socket_path) as c:
        resp = await c.call(SERVICE, "State", task.StateRequest(id="alive"), task.StateResponse)
        assert resp.id == "alive"


async def _send_and_close(socket_path: str, data: bytes) -> None:
    reader, writer = await asyncio.open_unix_connection(socket_path)
    writer.write(data)
    await writer.drain()
    if writer.can_write_eof():
        writer.write_eof()
    # Whatever the server answers, it must answer with well-formed frames or close.
    try:
        async with asyncio.timeout(2):
            while True:
                header = await reader.readexactly(HEADER.size)
                length, _, type_, _ = HEADER.unpack(header)
                assert type_ == 2 and length <= MAX_DATA
                Response.FromString(await reader.readexactly(length))
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    writer.close()


frames = st.builds(
    lambda length, sid, type_, flags, body: struct.pack(">IIBB", length, sid, type_, flags) + body,
    st.integers(0, 64), st.integers(0, 2**32 - 1), st.integers(0, 255), st.integers(0, 255),
    st.binary(max_size=64))


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.one_of(st.binary(max_size=256), st.lists(frames, max_size=5).map(b"".join)))
async def test_server_survives_garbage_and_truncated_frames(server, socket_path, data) -> None:
    await _send_and_close(socket_path, data)
    await _still_serves(socket_path)


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.integers(1, 40))
async def test_truncated_valid_frame_closes_only_that_connection(server, socket_path, cut):
    frame = request_frame(1, "truncated")
    async with await Client.connect(socket_path) as other:
        await _send_and_close(socket_path, frame[: min(cut, len(frame) - 1)])
        resp = await other.call(SERVICE, "State", task.StateRequest(id="other"),
                                task.StateResponse)
        assert resp.id == "other"
