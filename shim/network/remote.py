"""The daemon's side of shim/network/worker.py: attach and detach a pod's network in a
short-lived process, so that the daemon itself never loads the netlink library. Loads
only the model, the errors and shim/dataclassjson.py (the standard library alone): the
daemon starts a worker before it loads anything of the pod's model.

A Worker is started before its request is known (the pod's WorkerAhead starts one,
shim/network/ahead.py, and its boot and its shutdown use it). Forked by the fork server's
worker parent it is ready at once; started here, its Python start and pyroute2's import
(0.1 s on an idle node) overlap the plan and the cgroup, or the VM's stop. It serves one
request and exits; closed unused, it exits having done nothing."""
from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
from typing import Callable

from ..dataclassjson import dataclass_from_json
from .errors import NamespaceGone, NetworkError
from .model import PodNetwork, TapNic

MAX_REPLY = 1 << 20
MAX_FDS = 64  # two per interface (tap, vhost-net)


class Worker:
    def __init__(self, proc: asyncio.subprocess.Process | None, sock: socket.socket) -> None:
        self._proc = proc
        """None: a worker the fork server's worker parent forked, which the kernel reaps
        (shim/network/worker.py)."""
        self._sock = sock
        """Our end of the worker's socket."""
        self._used = False
        self._stderr: bytes | None = None
        """What the worker wrote on stderr, once it has exited and been waited for."""

    @classmethod
    async def start(cls) -> Worker:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            proc = await asyncio.create_subprocess_exec(
                *worker_argv(theirs.fileno()), pass_fds=(theirs.fileno(),),
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        return cls(proc, ours)

    @classmethod
    def forked(cls, parent: socket.socket) -> Worker | None:
        """A worker forked by the fork server's worker parent (shim/network/worker.py,
        --parent), its imports done already: the parent is sent the worker's end of a
        new socket. None when the parent is gone (its server exited) or does not take it
        now: the caller starts a worker of its own."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            socket.send_fds(parent, [b"w"], [theirs.fileno()], socket.MSG_DONTWAIT)
        except OSError:
            ours.close()
            return None
        finally:
            theirs.close()
        return cls(None, ours)

    async def attach(self, netns: str, found: Callable[[PodNetwork], None] | None = None
                     ) -> tuple[PodNetwork, tuple[TapNic, ...]]:
        """The pod's network as CNI left it, and one TapNic per interface, whose
        descriptors the caller owns (TapNic.close() once QEMU has them). `found` is
        given the network as soon as the worker has read it, before the taps are made."""
        reply, fds = await self._call("attach", netns)
        if "found" in reply:
            try:
                network = _network(reply["found"])
            except ValueError as exc:
                raise NetworkError(netns, "read the network worker's answer",
                                   repr(exc)) from None
            if found is not None:
                found(network)
            reply, fds = await self._answer("attach", netns)
        return _nics(netns, reply, fds)

    async def detach(self, netns: str, taps: list[str] | tuple[str, ...] = ()) -> None:
        """Remove podvm's taps and redirects from the namespace; idempotent."""
        await self._call("detach", netns, taps)

    async def close(self) -> None:
        """Wait for the worker's exit: one that served no request sees our end close and
        exits having done nothing. Idempotent."""
        self._sock.close()
        if self._stderr is None and self._proc is not None:
            _, self._stderr = await self._proc.communicate()

    async def _call(self, op: str, netns: str,
                    taps: list[str] | tuple[str, ...] = ()) -> tuple[dict, list[int]]:
        """The worker's answer as soon as it comes: its exit (pyroute2's teardown) is
        left to close()."""
        if self._used or self._sock.fileno() < 0:
            raise RuntimeError("a network worker serves one request")
        self._used = True
        try:
            self._sock.send(_request(op, netns, taps))
        except OSError:
            pass  # it died first: its status and stderr say how
        return await self._answer(op, netns)

    async def _answer(self, op: str, netns: str) -> tuple[dict, list[int]]:
        """The worker's next message."""
        await _readable(self._sock)
        data, fds = _receive(self._sock)
        if not data:
            await self.close()
            raise _no_answer(op, netns, self._proc.returncode if self._proc else None,
                             self._stderr or b"")
        return _reply(netns, data, fds)


async def detach(netns: str, taps: list[str] | tuple[str, ...] = ()) -> None:
    """Worker.detach() in a worker started for it."""
    worker = await Worker.start()
    try:
        await worker.detach(netns, taps)
    finally:
        await worker.close()


def detach_now(netns: str, taps: list[str] | tuple[str, ...] = ()) -> None:
    """detach() for code without an event loop (`delete` after a crash)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with ours:
        try:
            proc = subprocess.Popen(worker_argv(theirs.fileno()),
                                    pass_fds=(theirs.fileno(),),
                                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.PIPE)
        finally:
            theirs.close()
        ours.send(_request("detach", netns, taps))
        _, stderr = proc.communicate()
        data, fds = _receive(ours)
        if not data:
            raise _no_answer("detach", netns, proc.returncode, stderr)
        _reply(netns, data, fds)


def worker_argv(fd: int) -> list[str]:
    """The command line of a worker that answers on the inherited socket `fd`."""
    return [sys.executable, "-m", "shim.network.worker", "--socket", str(fd)]


def _request(op: str, netns: str, taps: list[str] | tuple[str, ...]) -> bytes:
    return json.dumps({"op": op, "netns": netns, "taps": list(taps)}).encode()


def _network(data: object) -> PodNetwork:
    """ValueError when `data` is not a PodNetwork's JSON."""
    return dataclass_from_json(PodNetwork, data, "the network worker's answer")


def _nics(netns: str, reply: dict, fds: list[int]) -> tuple[PodNetwork, tuple[TapNic, ...]]:
    try:
        network = _network(reply["network"])
        nics, taken = [], 0
        for n in reply["nics"]:
            tap_fd = fds[taken]
            vhost_fd = fds[taken + 1] if n["vhost"] else None
            taken += 2 if n["vhost"] else 1
            nics.append(TapNic(n["index"], n["interface"], n["tap"], n["mac"], n["mtu"],
                               tap_fd, vhost_fd))
        if taken != len(fds):
            raise ValueError(f"{len(fds)} descriptors for {taken}")
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        for fd in fds:
            os.close(fd)
        raise NetworkError(netns, "read the network worker's answer", repr(exc)) from None
    return network, tuple(nics)


async def _readable(sock: socket.socket) -> None:
    """Until `sock` has a message, or the worker's end is closed."""
    loop = asyncio.get_running_loop()
    ready = loop.create_future()
    loop.add_reader(sock.fileno(), lambda: ready.done() or ready.set_result(None))
    try:
        await ready
    finally:
        loop.remove_reader(sock.fileno())


def _receive(sock: socket.socket) -> tuple[bytes, list[int]]:
    """The worker's one message and its descriptors; b"" when it closed without one."""
    sock.setblocking(False)
    try:
        data, fds, _, _ = socket.recv_fds(sock, MAX_REPLY, MAX_FDS)
    except BlockingIOError:
        return b"", []
    return data, fds


def _no_answer(op: str, netns: str, status: int | None, stderr: bytes) -> NetworkError:
    tail = stderr.decode(errors="replace").strip().splitlines()[-5:]
    return NetworkError(netns, f"{op} (network worker)",
                        f"exited with status {status} without answering"
                        + (": " + " | ".join(tail) if tail else ""))


def _reply(netns: str, data: bytes, fds: list[int]) -> tuple[dict, list[int]]:
    """The worker's answer, or its NetworkError raised."""
    reply = json.loads(data)
    error = reply.get("error")
    if error is not None:
        for fd in fds:
            os.close(fd)
        cls = NamespaceGone if error.get("gone") else NetworkError
        raise cls(netns, error["step"], error["cause"], error.get("interface"))
    return reply, fds
