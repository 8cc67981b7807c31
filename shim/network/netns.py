"""Working in a pod's network namespace from the shim's one thread.

Things bound to a namespace (a netlink socket, a /dev/net/tun file) are made inside it:
the calling thread enters the namespace with setns(2), makes them, and comes back before
anything else runs on it. setns of a network namespace changes the calling thread only,
so other threads of the process are never affected; inside, nothing awaits, so no other
coroutine of the loop runs there. Everything else is done through what was made inside:
netlink requests act on the namespace their socket belongs to."""
from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import socket
from typing import AsyncIterator, Callable, Iterator, TypeVar

from pyroute2 import AsyncIPRoute, NetlinkError

from .errors import NamespaceGone, NetworkError

CLONE_NEWNET = 0x40000000
NETLINK_ROUTE = 0
T = TypeVar("T")

_libc = ctypes.CDLL(None, use_errno=True)
_libc.setns.argtypes = [ctypes.c_int, ctypes.c_int]


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


@contextlib.contextmanager
def _entered(netns: str) -> Iterator[None]:
    try:
        target = os.open(netns, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise NamespaceGone(netns, "open the namespace", "no such file") from None
    except OSError as exc:
        raise NetworkError(netns, "open the namespace", exc.strerror or str(exc)) from None
    try:
        own = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            try:
                _setns(target)
            except OSError as exc:
                if exc.errno == errno.EINVAL:  # a file that is no (longer a) namespace
                    raise NamespaceGone(netns, "enter the namespace",
                                        "not a network namespace") from None
                raise NetworkError(netns, "enter the namespace", exc.strerror) from None
            try:
                yield
            finally:
                _setns(own)  # our own namespace, held open: cannot be refused
        finally:
            os.close(own)
    finally:
        os.close(target)


def made_inside(netns: str, make: Callable[[], T]) -> T:
    """`make()` run by this thread inside `netns` (it must not block or yield to the
    loop). NamespaceGone when the path names no namespace; `make`'s own errors pass."""
    with _entered(netns):
        return make()


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
