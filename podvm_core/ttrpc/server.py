"""An asyncio ttrpc server: one reader per connection, every request served concurrently.

The server never dies of a client: a frame it cannot read closes that connection only,
and every request that can be answered is answered with a status code.
"""
from __future__ import annotations

import asyncio
import logging
import socket
from typing import Callable, Iterable

from google.protobuf.message import DecodeError

from podvm_core.pb.ttrpc_pb2 import Request, Response

from . import framing
from .codes import Code
from .errors import TtrpcError
from .service import Context, Service

log = logging.getLogger("podvm.ttrpc")

# How loudly a handler's error reply is logged, by its code. NOT_FOUND is an expected
# outcome: containerd keeps asking for tasks it has deleted (State, Wait, Delete, Kill of
# a gone id) and relies on the answer, so it is debug only. UNKNOWN and INTERNAL say the
# shim itself went wrong. Every other code is a request refused for a reason worth a line.
_LOG_LEVEL = {Code.NOT_FOUND: logging.DEBUG, Code.UNKNOWN: logging.WARNING,
              Code.INTERNAL: logging.WARNING, Code.DATA_LOSS: logging.WARNING}


class Server:
    def __init__(self, services: Iterable[Service] = (),
                 answer: Callable[[Exception], TtrpcError] | None = None) -> None:
        """`answer`: the reply to a handler's own typed error (code UNKNOWN for a bug);
        without it every error that is not a TtrpcError is UNKNOWN."""
        self._services: dict[str, Service] = {}
        self._deferred: dict[str, Callable[[], Service]] = {}
        self._answer = answer or (lambda exc: TtrpcError(Code.UNKNOWN, str(exc)))
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[asyncio.Task] = set()
        for service in services:
            self.register(service)

    def register(self, service: Service) -> None:
        self._services[service.name] = service

    def register_deferred(self, name: str, make: Callable[[], Service]) -> None:
        """Serve `name` with the Service that `make()` returns, made at the first call for
        it: what few peers call need not be loaded by every server that starts."""
        self._deferred[name] = make

    def _service(self, name: str) -> Service | None:
        service = self._services.get(name)
        if service is None and name in self._deferred:
            service = self._deferred[name]()  # a failure here is answered like a handler's
            del self._deferred[name]
            self._services[name] = service
        return service

    async def start(self, sock: socket.socket) -> None:
        """Serve on an already bound, listening unix socket (the shim's is made by `start`)."""
        self._server = await asyncio.start_unix_server(self._serve_connection, sock=sock)

    async def start_path(self, path: str) -> None:
        self._server = await asyncio.start_unix_server(self._serve_connection, path=path)

    async def serve_stream(self, reader: asyncio.StreamReader,
                           writer: asyncio.StreamWriter) -> None:
        """Serve one already open byte stream (the guest agent's virtio-serial port)
        until it ends."""
        await self._serve_connection(reader, writer)

    async def close(self, grace: float = 0.0) -> None:
        """Stop accepting, give the peers up to `grace` seconds to hang up themselves, then
        drop every connection; outstanding calls get no answer.

        The grace is for an answer just written, such as Shutdown's: a Go ttrpc client
        whose connection closes right after an answer arrived may fail that call with
        "ttrpc: closed" (its receive loop hands the answer over on a channel, and a
        select between it and the close picks either), and containerd 2.x does not
        forgive that for ShutdownSandbox. Go shims linger the same way (ttrpc's
        Server.Shutdown closes idle connections on a poll)."""
        if self._server is not None:
            self._server.close()
        if grace > 0 and self._connections:
            await asyncio.wait(list(self._connections), timeout=grace)
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def _serve_connection(self, reader: asyncio.StreamReader,
                                writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        conn = _Connection(self._service, reader, writer, self._answer)
        try:
            await conn.run()
        except asyncio.CancelledError:
            pass
        finally:
            self._connections.discard(task)
            await conn.close()


class _Connection:
    def __init__(self, lookup: Callable[[str], Service | None],
                 reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 answer: Callable[[Exception], TtrpcError]) -> None:
        self._lookup = lookup
        self._answer = answer
        self._reader = reader
        self._writer = writer
        self._last_stream_id = 0
        self._calls: set[asyncio.Task] = set()

    async def run(self) -> None:
        while True:
            try:
                frame = await framing.read_frame(self._reader)
            except asyncio.IncompleteReadError:
                log.warning("ttrpc: connection closed in the middle of a frame")
                return
            except (ConnectionError, OSError) as exc:
                log.debug("ttrpc: connection lost: %s", exc)
                return
            if frame is None:
                return
            if frame.oversized:
                await self._send_status(frame.stream_id, Code.RESOURCE_EXHAUSTED,
                                  f"message length {frame.oversized} exceeds the maximum "
                                  f"message size of {framing.MAX_DATA}")
                continue
            if frame.type != framing.MessageType.REQUEST:
                continue  # Data frames and unknown types: no unary service reads them.
            if frame.stream_id % 2 != 1:
                await self._send_status(frame.stream_id, Code.INVALID_ARGUMENT,
                                  "stream id must be odd for client initiated streams")
                continue
            if frame.stream_id <= self._last_stream_id:
                await self._send_status(frame.stream_id, Code.INVALID_ARGUMENT,
                                  "stream id cannot be re-used and must increment")
                continue
            self._last_stream_id = frame.stream_id
            call = asyncio.create_task(self._serve_request(frame.stream_id, frame.data))
            self._calls.add(call)
            call.add_done_callback(self._calls.discard)

    async def close(self) -> None:
        for call in list(self._calls):
            call.cancel()
        await asyncio.gather(*self._calls, return_exceptions=True)
        self._writer.close()
        try:
            await self._writer.wait_closed()
        except (ConnectionError, OSError):
            pass
        except NotImplementedError:
            pass  # a pipe-backed stream (the guest's virtio port) cannot wait: it is closed

    async def _serve_request(self, stream_id: int, data: bytes) -> None:
        try:
            payload = await self._dispatch(data)
        except TtrpcError as err:
            await self._send_status(stream_id, err.code, err.message)
            return
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a handler bug must not take the connection down
            answer = self._answer(exc)
            if answer.code is Code.UNKNOWN:
                log.exception("ttrpc: handler failed")
                answer = TtrpcError(Code.UNKNOWN, f"{type(exc).__name__}: {exc}")
            await self._send_status(stream_id, answer.code, answer.message)
            return
        if len(payload) > framing.MAX_DATA - 16:
            await self._send_status(stream_id, Code.RESOURCE_EXHAUSTED,
                              f"response of {len(payload)} bytes exceeds the maximum "
                              f"message size of {framing.MAX_DATA}")
            return
        await self._send(stream_id, Response(payload=payload).SerializeToString())

    async def _dispatch(self, data: bytes) -> bytes:
        try:
            request = Request.FromString(data)
        except DecodeError as exc:
            raise TtrpcError(Code.INVALID_ARGUMENT, f"unmarshal request error: {exc}") from None
        service = self._lookup(request.service)
        if service is None:
            raise TtrpcError(Code.UNIMPLEMENTED, f"service {request.service}")
        method = service.methods.get(request.method)
        if method is None:
            raise TtrpcError(Code.UNIMPLEMENTED, f"method {request.method}")
        try:
            message = method.request_type.FromString(request.payload)
        except DecodeError as exc:
            raise TtrpcError(Code.INVALID_ARGUMENT,
                             f"cannot decode {method.request_type.DESCRIPTOR.full_name}: {exc}"
                             ) from None
        timeout = request.timeout_nano / 1e9 if request.timeout_nano > 0 else None
        ctx = Context(request.service, request.method,
                      tuple((kv.key, kv.value) for kv in request.metadata), timeout)
        try:
            if timeout is None:  # most calls: no deadline to arm
                reply = await method.handler(message, ctx)
            else:
                try:
                    async with asyncio.timeout(timeout):
                        reply = await method.handler(message, ctx)
                except TimeoutError:
                    raise TtrpcError(Code.DEADLINE_EXCEEDED,
                                     f"{request.service}/{request.method} did not finish "
                                     f"within {timeout:.3f}s") from None
        except TtrpcError as err:
            level = _LOG_LEVEL.get(err.code, logging.INFO)
            if log.isEnabledFor(level):
                log.log(level, "%s/%s answered %s: %s", request.service, request.method,
                        err.code.name, err.message)
            raise
        return reply.SerializeToString()

    async def _send_status(self, stream_id: int, code: Code, message: str) -> None:
        response = Response()
        response.status.code = code
        response.status.message = message
        await self._send(stream_id, response.SerializeToString())

    async def _send(self, stream_id: int, data: bytes) -> None:
        if self._writer.is_closing():
            return
        self._writer.write(framing.encode(stream_id, framing.MessageType.RESPONSE, data))
        try:
            await self._writer.drain()
        except (ConnectionError, OSError):
            pass  # the reader sees the same loss and ends the connection
