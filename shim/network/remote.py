"""The daemon's side of shim/network/worker.py: attach and detach a pod's network in a
short-lived process, so that the daemon itself never loads the netlink library. Loads
only the model and the errors."""
from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys

from .errors import NamespaceGone, NetworkError
from ..podstate import dataclass_from_json
from .model import PodNetwork, TapNic

MAX_REPLY = 1 << 20
MAX_FDS = 64  # two per interface (tap, vhost-net)


async def attach(netns: str) -> tuple[PodNetwork, tuple[TapNic, ...]]:
    """The pod's network as CNI left it, and one TapNic per interface, whose descriptors
    the caller owns (TapNic.close() once QEMU has them)."""
    reply, fds = await _run("attach", netns)
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


async def detach(netns: str, taps: list[str] | tuple[str, ...] = ()) -> None:
    """Remove podvm's taps and redirects from the namespace; idempotent."""
    await _run("detach", netns, *taps)


def detach_now(netns: str, taps: list[str] | tuple[str, ...] = ()) -> None:
    """detach() for code without an event loop (`delete` after a crash)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with ours:
        try:
            done = subprocess.run(_argv(theirs, "detach", netns, *taps),
                                  pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        finally:
            theirs.close()
        _answer(ours, "detach", netns, done.returncode, done.stderr)


async def _run(op: str, netns: str, *args: str) -> tuple[dict, list[int]]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with ours:
        try:
            proc = await asyncio.create_subprocess_exec(
                *_argv(theirs, op, netns, *args), pass_fds=(theirs.fileno(),),
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE)
        finally:
            theirs.close()
        _, stderr = await proc.communicate()
        return _answer(ours, op, netns, proc.returncode, stderr)


def _argv(sock: socket.socket, op: str, netns: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "shim.network.worker", "--socket", str(sock.fileno()),
            op, netns, *args]


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
