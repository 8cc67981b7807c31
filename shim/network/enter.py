"""Entering a pod's network namespace from the shim's one thread, without a netlink
library: what the daemon itself may load (`netns.py` builds pyroute2's client on it).

Things bound to a namespace (a netlink socket, a /dev/net/tun file, a listening socket)
are made inside it: the calling thread enters the namespace with setns(2), makes them,
and comes back before anything else runs on it. setns of a network namespace changes the
calling thread only, so other threads of the process are never affected; inside, nothing
awaits, so no other coroutine of the loop runs there."""
from __future__ import annotations

import contextlib
import errno
import os
from typing import Callable, Iterator, TypeVar

from ..libc import last_errno, libc
from .errors import NamespaceGone, NetworkError

CLONE_NEWNET = 0x40000000
T = TypeVar("T")

def _setns(fd: int) -> None:
    if libc().setns(fd, CLONE_NEWNET) != 0:
        err = last_errno()
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
