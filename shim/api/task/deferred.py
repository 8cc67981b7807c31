"""The Task API as the daemon serves it: its handlers are a TaskService
(shim/api/task/service.py), made at the first call that needs one."""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Callable

from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass

from podvm_core.pb.containerd.task.v2 import shim_pb2
from podvm_core.ttrpc import Code, Context, Method, Service, TtrpcError, bind
from podvm_core.ttrpc.service import Handler

from ... import __version__
from ..events import Publisher

if TYPE_CHECKING:
    from ...pod.podslot import PodSlot
    from .service import TaskService


class TaskAPI:
    """The Task API's handlers: a TaskService, made at the first call that needs one.

    containerd connects as soon as `start` returns, and a Connect before any Create needs
    only the API's messages; TaskService brings the pod's whole model (its imports are
    about a quarter of the daemon's start). The first Create, which boots the VM, pays
    for them instead."""

    def __init__(self, namespace: str, publisher: Publisher,
                 shutdown: Callable[[], None], slot: PodSlot | None = None) -> None:
        """`slot`: the daemon's, shared with the Sandbox API."""
        self._namespace = namespace
        self._publisher = publisher
        self._shutdown = shutdown
        self._slot = slot
        self._service: TaskService | None = None
        self._bound: list[tuple[ServiceDescriptor, Service]] = []

    def bind(self, descriptor: ServiceDescriptor, name: str) -> Service:
        """The Task API as `name`: every RPC of `descriptor` (whichever TaskService lacks
        answers UNIMPLEMENTED, as `bind` would), the real handlers once it is made."""
        service = Service(name)
        for rpc in descriptor.methods:
            handler = self.Connect if rpc.name == "Connect" else self._first_call(rpc.name)
            service.methods[rpc.name] = Method(GetMessageClass(rpc.input_type), handler)
        self._bound.append((descriptor, service))
        return service

    def get(self) -> TaskService:
        if self._service is None:
            # Here, not at the top: see the class's docstring.
            from .service import TaskService

            self._service = TaskService(self._namespace, self._publisher,
                                        shutdown=self._shutdown, slot=self._slot)
            for descriptor, service in self._bound:  # from now on, straight to it
                service.methods = bind(descriptor, self._service, name=service.name).methods
        return self._service

    async def Connect(self, req: shim_pb2.ConnectRequest,
                      ctx: Context) -> shim_pb2.ConnectResponse:
        if self._service is None:  # no Create yet, so no task: TaskService's answer
            return shim_pb2.ConnectResponse(shim_pid=os.getpid(), version=__version__)
        return await self._service.Connect(req, ctx)

    def _first_call(self, rpc: str) -> Handler:
        async def call(req: Message, ctx: Context) -> Message:
            handler = getattr(self.get(), rpc, None)
            if handler is None:
                raise TtrpcError(Code.UNIMPLEMENTED, f"method {rpc}")
            return await handler(req, ctx)

        return call

    async def close(self) -> None:
        if self._service is not None:
            await self._service.close()
