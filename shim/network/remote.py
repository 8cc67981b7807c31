"""The daemon's side of shim/network/worker.py: attach and detach a pod's network in a
short-lived process, so that the daemon itself never loads the netlink library. Loads
only the model and the errors.

A Worker is started before its request is known (a pod's Create starts one, its boot
uses it): the worker's Python start and pyroute2's import, 0.1 s, overlap the plan and
the cgroup instead of adding to them. It serves one request and exits; closed unused, it
exits having done nothing."""
from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys

from .errors import NamespaceGone, NetworkError
from .model import PodNetwork, TapNic

MAX_REPLY = 1 << 20
MAX_FDS = 64  # two per interface (tap, vhost-net)


class Worker:
    def __init__(self, proc: asyncio.subprocess.Process, sock: socket.socket) -> None:
        self._proc = proc
        self._sock: socket.socket | None = sock
        """Our end of the worker's socket; None once a request went (or it was closed)."""

    @classmethod
    async def start(cls) -> Worker:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            proc = await asyncio.create_subprocess_exec(
                *_argv(theirs), pass_fds=(theirs.fileno(),),
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        return cls(proc, ours)

    async def attach(self, netns: str) -> tuple[PodNetwork, tuple[TapNic, ...]]:
        """The pod's network as CNI left it, and one TapNic per interface, whose
        descriptors the caller owns (TapNic.close() once QEMU has them)."""
        reply, fds = await self._call("attach", netns)
        return _nics(netns, reply, fds)

    async def detach(self, netns: str, taps: list[str] | tuple[str, ...] = ()) -> None:
        """Remove podvm's taps and redirects from the namespace; idempotent."""
        await self._call("detach", netns, taps)

    async def close(self) -> None:
        """End a worker that served no request; a no-op for one that did."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            await self._proc.communicate()

    async def _call(self, op: str, netns: str,
                    taps: list[str] | tuple[str, ...] = ()) -> tuple[dict, list[int]]:
        if self._sock is None:
            raise RuntimeError("a network worker serves one request")
        sock, self._sock = self._sock, None
        with sock:
            try:
                sock.send(_request(op, netns, taps))
            except OSError:
                pass  # it died first: its status and stderr say how
            _, stderr = await self._proc.communicate()
            return _answer(sock, op, netns, self._proc.returncode, stderr)


async def attach(netns: str) -> tuple[PodNetwork, tuple[TapNic, ...]]:
    """Worker.attach() in a worker started for it."""
    return await (await Worker.start()).attach(netns)


async def detach(netns: str, taps: list[str] | tuple[str, ...] = ()) -> None:
    """Worker.detach() in a worker started for it."""
    await (await Worker.start()).detach(netns, taps)


def detach_now(netns: str, taps: list[str] | tuple[str, ...] = ()) -> None:
    """detach() for code without an event loop (`delete` after a crash)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with ours:
        try:
            proc = subprocess.Popen(_argv(theirs), pass_fds=(theirs.fileno(),),
                                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.PIPE)
        finally:
            theirs.close()
        ours.send(_request("detach", netns, taps))
        _, stderr = proc.communicate()
        _answer(ours, "detach", netns, proc.returncode, stderr)


def _argv(sock: socket.socket) -> list[str]:
    return [sys.executable, "-m", "shim.network.worker", "--socket", str(sock.fileno())]


def _request(op: str, netns: str, taps: list[str] | tuple[str, ...]) -> bytes:
    return json.dumps({"op": op, "netns": netns, "taps": list(taps)}).encode()


def _nics(netns: str, reply: dict, fds: list[int]) -> tuple[PodNetwork, tuple[TapNic, ...]]:
    # Here, not at the top: the daemon starts a worker before it loads the pod's model.
    from ..podstate import dataclass_from_json

    try:
        network = dataclass_from_json(PodNetwork, reply["network"], "the network worker's answer")
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


def _answer(sock: socket.socket, op: str, netns: str, status: int | None,
            stderr: bytes) -> tuple[dict, list[int]]:
    """The worker's one message (it has exited), or its NetworkError raised."""
    sock.setblocking(False)
    try:
        data, fds, _, _ = socket.recv_fds(sock, MAX_REPLY, MAX_FDS)
    except BlockingIOError:
        data, fds = b"", []
    if not data:
        tail = stderr.decode(errors="replace").strip().splitlines()[-5:]
        raise NetworkError(netns, f"{op} (network worker)",
                           f"exited with status {status} without answering"
                           + (": " + " | ".join(tail) if tail else ""))
    reply = json.loads(data)
    error = reply.get("error")
    if error is not None:
        for fd in fds:
            os.close(fd)
        cls = NamespaceGone if error.get("gone") else NetworkError
        raise cls(netns, error["step"], error["cause"], error.get("interface"))
    return reply, fds
