"""ttrpc for asyncio: containerd's lightweight RPC (docs/design.md, Transport).

The client loads at its first use: the guest agent only serves, and the client's import
is ~30 ms of its start under TCG (-X importtime in the guest)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from .codes import Code
from .errors import ConnectionClosed, TtrpcError
from .server import Server
from .service import Context, Method, Service, bind

if TYPE_CHECKING:
    from .client import Client

__all__ = ["Client", "Code", "ConnectionClosed", "Context", "Method", "Server", "Service",
           "TtrpcError", "bind"]


def __getattr__(name: str) -> object:
    if name == "Client":
        from .client import Client  # at its first use: see the module's docstring

        return Client
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
