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

usage: python -m shim.network.worker --socket FD"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import socket
import sys

from ..libc import die_with_parent
from .attach import attach
from .detach import detach
from .errors import NamespaceGone, NetworkError
from .read import read_network

MAX_REQUEST = 1 << 16


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shim.network.worker",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--socket", type=int, required=True,
                        help="the inherited AF_UNIX socket to answer on")
    parser.add_argument("--spare", type=int, metavar="POLICY",
                        help="started by the fork server at SCHED_IDLE to load: serve "
                             "under this scheduling policy (a daemon's)")
    args = parser.parse_args(argv)
    if args.spare is not None:  # loaded: serve as the daemon that will ask would
        os.sched_setscheduler(0, args.spare, os.sched_param(0))
    else:
        # Its work is its parent's (a daemon's, a `delete`'s): it ends with it. Not a
        # spare: the fork server that started it may go while a daemon uses it.
        die_with_parent()
    sock = socket.socket(fileno=args.socket)
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


if __name__ == "__main__":
    status = main()
    sys.stderr.flush()
    # No interpreter teardown: with pyroute2 loaded it is 0.1 s of CPU, taken from the
    # guest that boots meanwhile, for nothing (the kernel closes what the worker holds).
    os._exit(status)
