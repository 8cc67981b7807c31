"""ttrpc for asyncio: containerd's lightweight RPC (protocol.md section 1)."""
from .client import Client
from .codes import Code
from .errors import ConnectionClosed, TtrpcError
from .server import Server
from .service import Context, Method, Service, bind

__all__ = ["Client", "Code", "ConnectionClosed", "Context", "Method", "Server", "Service",
           "TtrpcError", "bind"]
