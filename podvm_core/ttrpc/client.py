"""An asyncio ttrpc client: many calls in flight on one connection, matched by stream id."""
from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Iterable, TypeVar

from google.protobuf.message import DecodeError, Message

from podvm_core.pb.ttrpc_pb2 import KeyValue, Request, Response

from . import framing
from .codes import Code
from .errors import ConnectionClosed, TtrpcError

log = logging.getLogger("podvm.ttrpc")

M = TypeVar("M", bound=Message)
_GRACE = 1.0
_MAX_UNSENT = 2 * framing.MAX_DATA
"""Bytes of requests a peer that stopped reading may leave unsent before calls are refused:
else each call given up on leaves its request buffered, and memory grows with every try."""
_CODES = frozenset(Code)
"""A peer's status code outside ttrpc's table is UNKNOWN, not a ValueError in the caller."""


class Client:
    """Use `await Client.connect(path)`; `close()` fails whatever is still outstanding."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 metadata: Iterable[tuple[str, str]] = ()) -> None:
        self._reader = reader
        self._writer = writer
        self._metadata = tuple(metadata)
        self._stream_ids = itertools.count(1, 2)
        self._pending: dict[int, asyncio.Future[Response]] = {}
        self._closed: BaseException | None = None
        self._receiver = asyncio.create_task(self._receive())

    @classmethod
    async def connect(cls, path: str, metadata: Iterable[tuple[str, str]] = ()) -> "Client":
        """Connect to a unix socket; `path` may carry containerd's `unix://` prefix."""
        reader, writer = await asyncio.open_unix_connection(path.removeprefix("unix://"))
        return cls(reader, writer, metadata)

    async def call(self, service: str, method: str, request: Message, response_type: type[M],
                   timeout: float | None = None,
                   metadata: Iterable[tuple[str, str]] = (), grace: float = _GRACE) -> M:
        """One unary call. A non-OK status raises TtrpcError; a lost connection ConnectionClosed.
        `grace`: how long past `timeout` the answer is still waited for (the server's own
        DEADLINE_EXCEEDED, or a result it had just made)."""
        raw = await self.call_raw(service, method, request.SerializeToString(), timeout,
                                  metadata, grace)
        try:
            return response_type.FromString(raw)
        except DecodeError as exc:
            raise TtrpcError(Code.INTERNAL, f"cannot decode the {service}/{method} response "
                                            f"as {response_type.DESCRIPTOR.full_name}: {exc}")

    async def call_raw(self, service: str, method: str, payload: bytes,
                       timeout: float | None = None,
                       metadata: Iterable[tuple[str, str]] = (), grace: float = _GRACE) -> bytes:
        if self._closed is not None:
            raise ConnectionClosed(f"ttrpc connection is closed: {self._closed}")
        req = Request(service=service, method=method, payload=payload,
                      timeout_nano=int(timeout * 1e9) if timeout else 0,
                      metadata=[KeyValue(key=k, value=v)
                                for k, v in (*self._metadata, *metadata)])
        data = req.SerializeToString()
        if len(data) > framing.MAX_DATA:
            raise TtrpcError(Code.RESOURCE_EXHAUSTED,
                             f"request of {len(data)} bytes exceeds the maximum message size "
                             f"of {framing.MAX_DATA}")
        if self._writer.transport.get_write_buffer_size() > _MAX_UNSENT:
            raise TtrpcError(Code.RESOURCE_EXHAUSTED,
                             f"{service}/{method}: the peer has not read the "
                             f"{self._writer.transport.get_write_buffer_size()} bytes sent "
                             f"before")
        stream_id = next(self._stream_ids)
        future: asyncio.Future[Response] = asyncio.get_running_loop().create_future()
        self._pending[stream_id] = future
        try:
            # The server enforces the deadline and says so; this guards against a server
            # that never answers, or stops reading (drain() waits as long as it does). A
            # frame is buffered whole by write(), so a drain given up leaves it in step.
            async with asyncio.timeout(timeout + grace if timeout else None):
                self._writer.write(framing.encode(stream_id, framing.MessageType.REQUEST, data))
                await self._writer.drain()
                response = await future
        except TimeoutError:
            raise TtrpcError(Code.DEADLINE_EXCEEDED,
                             f"{service}/{method}: no answer within {timeout:.3f}s") from None
        except (ConnectionError, OSError) as exc:
            raise ConnectionClosed(f"ttrpc connection lost: {exc}") from exc
        finally:
            self._pending.pop(stream_id, None)
        if response.status.code != Code.OK:
            code = response.status.code
            raise TtrpcError(code if code in _CODES else Code.UNKNOWN, response.status.message)
        return response.payload

    async def close(self) -> None:
        self._fail_pending(ConnectionClosed("ttrpc client closed"))
        self._receiver.cancel()
        self._writer.close()
        try:
            async with asyncio.timeout(_GRACE):
                await self._writer.wait_closed()
        except TimeoutError:  # a peer that reads nothing more: what it left unread goes
            self._writer.transport.abort()
        except (ConnectionError, OSError):
            pass
        try:
            await self._receiver
        except asyncio.CancelledError:
            pass

    async def __aenter__(self) -> "Client":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _receive(self) -> None:
        reason: BaseException = ConnectionClosed("ttrpc server closed the connection")
        try:
            while True:
                frame = await framing.read_frame(self._reader)
                if frame is None:
                    break
                future = self._pending.get(frame.stream_id)
                if future is None or future.done():
                    continue
                if frame.oversized:
                    future.set_exception(TtrpcError(
                        Code.RESOURCE_EXHAUSTED, f"response of {frame.oversized} bytes exceeds "
                                                 f"the maximum message size of {framing.MAX_DATA}"))
                elif frame.type == framing.MessageType.RESPONSE:
                    try:
                        future.set_result(Response.FromString(frame.data))
                    except DecodeError as exc:
                        future.set_exception(TtrpcError(Code.INTERNAL,
                                                        f"undecodable ttrpc response: {exc}"))
        except (asyncio.IncompleteReadError, ConnectionError, OSError) as exc:
            reason = ConnectionClosed(f"ttrpc connection lost: {exc}")
        finally:
            self._fail_pending(reason)

    @property
    def closed(self) -> bool:
        """The connection is gone (closed here, by the peer, or lost)."""
        return self._closed is not None

    def _fail_pending(self, reason: BaseException) -> None:
        if self._closed is None:
            self._closed = reason
        for future in self._pending.values():
            if not future.done():
                future.set_exception(reason)
