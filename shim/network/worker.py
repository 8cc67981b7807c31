"""The process that speaks netlink for a pod's shim: `python -m shim.network.worker`.

The daemon never loads pyroute2 (about 18 MB of RSS and 0.12 s, for every pod, for what
is done twice in a pod's life). It runs this worker instead, once to attach and once to
detach: the worker does the work in the pod's namespace and answers on the socket it
inherited, one message of JSON, with the taps' and vhost-net's descriptors attached
(SCM_RIGHTS) when it attached. It exits at once: its copies of the descriptors close, the
shim's keep the taps alive until QEMU has its own.

It starts before it is needed and waits, its imports done, for its one request on that
socket: {"op": "attach" | "detach", "netns": PATH, "taps": [NAME, ...]}. The socket
closed without one, it exits having done nothing. An attach says what it found first,
{"found": NETWORK}, before it makes the taps: the shim picks the pod's template from the
interfaces and starts copying its memory meanwhile.

With `--parent` it is the fork server's worker parent (shim/contract/workerparent.py): it
loads once and serves no request itself. Each message on its socket brings one socket
(SCM_RIGHTS), and it forks a worker, loaded already, that serves one request on it. A
daemon asks it for each of its pod's two workers (shim/network/remote.py, Worker.forked):
a fork costs milliseconds where a worker of its own costs its imports, 0.3 s of CPU, which
twenty pods stopped at once paid in seconds each (issue 47).

usage: python -m shim.network.worker --socket FD [--parent POLICY]"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import signal
import socket
import sys

from ..libc import die_with_parent
from .attach import attach
from .detach import detach
from .errors import NamespaceGone, NetworkError
from .read import read_network

MAX_REQUEST = 1 << 16
MAX_ASK = 16
"""A worker parent's message: a byte or so, and the socket it carries."""


def answer_error(exc: NetworkError) -> dict:
    return {"error": {"interface": exc.interface, "step": exc.step, "cause": exc.cause,
                      "gone": isinstance(exc, NamespaceGone)}}


async def _attach(netns: str, sock: socket.socket) -> tuple[dict, list[int]]:
    network = await read_network(netns)
    sock.send(json.dumps({"found": dataclasses.asdict(network)}).encode())
    nics = await attach(network)
    fds: list[int] = []
    for nic in nics:
        fds.extend(nic.fds)
    return {"network": dataclasses.asdict(network),
            "nics": [{"index": n.index, "interface": n.interface, "tap": n.tap,
                      "mac": n.mac, "mtu": n.mtu, "vhost": n.vhost_fd is not None}
                     for n in nics]}, fds


def serve(sock: socket.socket) -> int:
    """One request on `sock`, answered; none when its other end closes first."""
    request = sock.recv(MAX_REQUEST)
    if not request:
        return 0  # not needed after all
    request = json.loads(request)
    fds: list[int] = []
    try:
        if request["op"] == "attach":
            reply, fds = asyncio.run(_attach(request["netns"], sock))
        else:
            asyncio.run(detach(request["netns"], request["taps"]))
            reply = {"ok": True}
    except NetworkError as exc:
        reply = answer_error(exc)
    socket.send_fds(sock, [json.dumps(reply).encode()], fds)
    return 0


def serve_forks(asks: socket.socket) -> int:
    """The worker parent's life: a worker forked for each socket that comes on `asks`,
    until every holder of its other end has closed it (the fork server, and the daemons
    it forked) or the server kills it."""
    # Each worker is reaped by the kernel as it exits: the parent waits on none of them.
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    while True:
        try:
            data, fds, msg_flags, _ = socket.recv_fds(asks, MAX_ASK, 1)
        except InterruptedError:
            continue
        if not data and not fds:
            return 0
        if msg_flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC) or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            continue
        try:
            pid = os.fork()
        except OSError:
            os.close(fds[0])  # the asker sees its end close unanswered, and says so
            continue
        if pid == 0:
            asks.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            status = 1
            try:
                status = serve(socket.socket(fileno=fds[0]))
            finally:
                sys.stderr.flush()
                os._exit(status)
        os.close(fds[0])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shim.network.worker",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--socket", type=int, required=True,
                        help="the inherited AF_UNIX socket to answer (or, with --parent, "
                             "to be asked) on")
    parser.add_argument("--parent", type=int, metavar="POLICY",
                        help="the fork server's worker parent: fork a worker for each "
                             "socket sent on --socket, under this scheduling policy (the "
                             "daemons')")
    args = parser.parse_args(argv)
    sock = socket.socket(fileno=args.socket)
    if args.parent is not None:
        os.sched_setscheduler(0, args.parent, os.sched_param(0))
        return serve_forks(sock)
    # Its work is its parent's (a daemon's, a `delete`'s): it ends with it. Not a worker
    # parent's: the fork server that started it may go while a daemon's worker works.
    die_with_parent()
    return serve(sock)


if __name__ == "__main__":
    status = main()
    sys.stderr.flush()
    # No interpreter teardown: with pyroute2 loaded it is 0.1 s of CPU, taken from the
    # guest that boots meanwhile, for nothing (the kernel closes what the worker holds).
    os._exit(status)
