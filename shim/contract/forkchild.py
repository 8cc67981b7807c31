"""A daemon forked by the fork server (forkserver.py) becomes the one `start` would have
forked: its session, its working directory (the bundle), the environment containerd gave
`start`, `start`'s command line in /proc, the pod's own mount namespace, stdio on
/dev/null, and the pod's listening socket; nothing else of the server's. It serves only
once `start` has its pid and says GO (forkclient.py): a `start` that gave up has a
daemon of its own, and this one exits unseen."""
from __future__ import annotations

import json
import os
import signal
import socket
from typing import NamedTuple

from ..host.mountns import unshare_for_pod
from .flags import Flags
from .forkclient import GO
from .proctitle import set_cmdline


class Request(NamedTuple):
    flags: Flags
    env: dict[str, str]
    cmdline: bytes


def become_daemon(conn: socket.socket, request: Request, listener_fd: int, cwd_fd: int,
                  serve, workers_fd: int = -1) -> None:
    """In the fork server's grandchild; never returns. `workers_fd`: the socket of the
    server's worker parent (workerparent.py), -1 when it has none."""
    code = 1
    try:
        try:
            sock = _take(conn, request, listener_fd, cwd_fd, workers_fd)
        except Exception as exc:
            conn.send(json.dumps({"error": f"the forked daemon could not start: {exc}"})
                      .encode())
            raise
        conn.send(json.dumps({"pid": os.getpid()}).encode())
        if conn.recv(len(GO) + 1) != GO:
            return  # `start` gave up: it forks its own daemon
        conn.close()
        code = serve(request.flags, sock,
                     socket.socket(fileno=workers_fd) if workers_fd >= 0 else None)
    finally:
        os._exit(code)


def _take(conn: socket.socket, request: Request, listener_fd: int, cwd_fd: int,
          workers_fd: int) -> socket.socket:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # as a daemon `start` forks has it
    os.setsid()
    keep = sorted({conn.fileno(), listener_fd, cwd_fd} |
                  ({workers_fd} if workers_fd >= 0 else set()))
    low = 3
    for fd in keep:  # the server's listener and lock, and anything else of its
        os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, os.sysconf("SC_OPEN_MAX"))
    os.fchdir(cwd_fd)
    os.close(cwd_fd)
    os.environ.clear()
    os.environ.update(request.env)
    set_cmdline(request.cmdline, b"".join(k + b"=" + v + b"\0"
                                          for k, v in os.environb.items()))
    unshare_for_pod()
    return socket.socket(fileno=listener_fd)
