"""A guest agent played by an attacker with guest root: it speaks ttrpc on the shim's
agent connection (a socketpair here, the virtio-serial port in a pod), and answers each
method as its test scripts: at once, with a forged payload, with a status, or never (it
ignores the deadline the request carries, as a hostile guest may)."""
from __future__ import annotations

import asyncio
import socket
from collections import Counter
from typing import Awaitable, Callable

from google.protobuf.message import Message

from podvm_core.pb.ttrpc_pb2 import Request, Response
from podvm_core.ttrpc import Client, Code, framing
from shim.vm.agent import Agent

NEVER = None
"""A handler's answer meaning: no answer, ever."""

Handler = Callable[[Request], Awaitable[Message | Response | None]]


class HostileAgent:
    """`handlers[method]` makes the answer to each request of `method` (a message, a
    whole Response for a status, NEVER); methods without one are never answered."""

    def __init__(self, handlers: dict[str, Handler] | None = None) -> None:
        self.handlers = handlers or {}
        self.asked: Counter[str] = Counter()
        self._tasks: set[asyncio.Task] = set()
        self._server: asyncio.Task | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def connect(self, sandbox_id: str = "sb-hostile") -> Agent:
        """The shim's Agent, connected to this guest."""
        host, guest = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        reader, self._writer = await asyncio.open_unix_connection(sock=guest)
        self._server = asyncio.create_task(self._serve(reader))
        return Agent(Client(*await asyncio.open_unix_connection(sock=host)), sandbox_id)

    async def _serve(self, reader: asyncio.StreamReader) -> None:
        while (frame := await framing.read_frame(reader)) is not None:
            request = Request.FromString(frame.data)
            self.asked[request.method] += 1
            task = asyncio.create_task(self._answer(frame.stream_id, request))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _answer(self, stream_id: int, request: Request) -> None:
        handler = self.handlers.get(request.method)
        answer = await handler(request) if handler is not None else NEVER
        if answer is NEVER:
            await asyncio.Event().wait()
        response = answer if isinstance(answer, Response) else \
            Response(payload=answer.SerializeToString())
        assert self._writer is not None
        self._writer.write(framing.encode(stream_id, framing.MessageType.RESPONSE,
                                          response.SerializeToString()))

    async def close(self) -> None:
        for task in [*self._tasks, *([self._server] if self._server else [])]:
            task.cancel()
        await asyncio.gather(*self._tasks, *([self._server] if self._server else []),
                             return_exceptions=True)
        if self._writer is not None:
            self._writer.close()


def status(code: Code, message: str = "") -> Response:
    response = Response()
    response.status.code = code
    response.status.message = message
    return response


def always(message: Message | Response) -> Handler:
    async def handler(request: Request) -> Message | Response:
        return message
    return handler
