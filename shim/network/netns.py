"""Speaking netlink to a pod's network namespace: sockets made inside it (`enter.py`),
through which every request acts there."""
from __future__ import annotations

import contextlib
import os
import socket
from typing import AsyncIterator, Iterator

from pyroute2 import AsyncIPRoute, NetlinkError

from .enter import made_inside
from .errors import NetworkError

NETLINK_ROUTE = 0


def netlink_socket(netns: str) -> socket.socket:
    """A NETLINK_ROUTE socket of `netns`: every request on it acts there."""
    return made_inside(netns, lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM,
                                                    NETLINK_ROUTE))


@contextlib.asynccontextmanager
async def rtnl(netns: str) -> AsyncIterator[AsyncIPRoute]:
    """pyroute2's asyncio routing-netlink client for `netns`, on the running loop (its
    namespace support forks a child per socket; ours is made in place)."""
    sock = netlink_socket(netns)
    fd = sock.detach()
    try:
        ipr = AsyncIPRoute(fileno=fd)
    except BaseException:
        os.close(fd)
        raise
    async with ipr:
        yield ipr


@contextlib.contextmanager
def step(netns: str, what: str, interface: str | None = None) -> Iterator[None]:
    """A kernel refusal during `what` as a NetworkError naming the namespace, the
    interface and the step."""
    try:
        yield
    except NetworkError:
        raise
    except NetlinkError as exc:
        raise NetworkError(netns, what, f"{exc.args[-1]} (netlink error {exc.code})",
                           interface) from None
    except OSError as exc:
        raise NetworkError(netns, what, exc.strerror or str(exc), interface) from None
