"""Method tables: which handler serves `service/method`, and with which message types."""
from __future__ import annotations

from typing import Any, Awaitable, Callable, NamedTuple

from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass

Handler = Callable[[Any, "Context"], Awaitable[Message]]


# Named tuples and a plain class, not dataclasses: a context is made per call, and each
# dataclass costs the daemon's start path about 1 ms.
class Context(NamedTuple):
    """What a handler may know about the call besides its request."""

    service: str
    method: str
    metadata: tuple[tuple[str, str], ...] = ()
    timeout: float | None = None

    def get(self, key: str) -> str | None:
        """The first value of a metadata key (keys may repeat on the wire)."""
        for k, v in self.metadata:
            if k == key:
                return v
        return None

    @property
    def namespace(self) -> str | None:
        return self.get("containerd-namespace-ttrpc")


class Method(NamedTuple):
    request_type: type[Message]
    handler: Handler


class Service:
    __slots__ = ("name", "methods")

    def __init__(self, name: str, methods: dict[str, Method] | None = None) -> None:
        self.name = name
        self.methods: dict[str, Method] = {} if methods is None else methods

    def __repr__(self) -> str:
        return f"Service({self.name!r}, {sorted(self.methods)})"


def bind(descriptor: ServiceDescriptor, impl: object, name: str | None = None) -> Service:
    """A Service whose methods are `impl`'s coroutines named like the proto's RPCs.

    RPCs that `impl` does not define are left out, so callers get UNIMPLEMENTED.
    `name` serves the same handlers under another full name (task v2 and v3).
    """
    service = Service(name or descriptor.full_name)
    for rpc in descriptor.methods:
        handler = getattr(impl, rpc.name, None)
        if handler is not None:
            service.methods[rpc.name] = Method(GetMessageClass(rpc.input_type), handler)
    return service
