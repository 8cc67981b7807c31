"""`start`'s side of the fork server (forkserver.py): ask it for the pod's daemon, or
spawn it when none serves this code. Standard library only, and only its light parts:
`start` runs on containerd's critical path.

One request is one SOCK_SEQPACKET message: JSON (the daemon's flags, `start`'s
environment and command line) with two descriptors (SCM_RIGHTS): the pod's listening
socket and `start`'s working directory (the bundle). The answer is the daemon's
{"pid": N} or {"error": "..."}; `start` then sends GO, and only then does the daemon
serve: a `start` that gives up (no answer in REPLY_WAIT, any error) closes the
connection, the daemon sees it and exits without having served, and `start` forks its
daemon itself, as it does without a server."""
from __future__ import annotations

import os
import _socket  # not socket.py: its enums and selectors are 4 ms of every `start`
import struct
import sys
import time

from podvm_core import lightjson

from ..host.paths import STATE_ROOT

DIRECTORY = os.path.join(STATE_ROOT, ".forkserver")
"""The servers' sockets and locks, `<identity>.sock` and `<identity>.lock`: root's, 0700
(a dot name: no containerd namespace can be called that)."""
TEST_DIRECTORY_ENV = "PODVM_TEST_FORKSERVER_DIR"
"""Tests only: another directory (made 0700 and root's like DIRECTORY)."""
REPLY_WAIT = 3.0
"""Seconds `start` waits for the daemon's pid before it forks the daemon itself."""
MAX_MESSAGE = 1 << 18
GO = b"go"
_PEERCRED = struct.Struct("3i")


class ForkServerError(Exception):
    """A server was there but gave no daemon: the message says why."""


def directory() -> str:
    return os.environ.get(TEST_DIRECTORY_ENV) or DIRECTORY


def socket_path(identity: str, where: str | None = None) -> str:
    return os.path.join(where or directory(), identity + ".sock")


def lock_path(identity: str, where: str | None = None) -> str:
    return os.path.join(where or directory(), identity + ".lock")


def peer(conn: _socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end (SO_PEERCRED)."""
    return _PEERCRED.unpack(conn.getsockopt(_socket.SOL_SOCKET, _socket.SO_PEERCRED,
                                            _PEERCRED.size))


def _seqpacket() -> _socket.socket:
    return _socket.socket(_socket.AF_UNIX, _socket.SOCK_SEQPACKET | _socket.SOCK_CLOEXEC)


def request_daemon(identity: str, flags: dict, listener: _socket.socket
                   ) -> tuple[int, int] | None:
    """(the daemon's pid, the server's pid), or None when no server of `identity` listens
    (none was started, or its socket is stale). Raises ForkServerError for a server that
    did not give a daemon; then none serves on `listener`."""
    conn = _seqpacket()
    try:
        try:
            conn.connect(socket_path(identity))
        except (FileNotFoundError, ConnectionRefusedError):
            return None
        try:
            return _ask(conn, flags, listener)
        except OSError as exc:  # a timeout included
            raise ForkServerError(f"the fork server did not answer: {exc!r}") from None
    finally:
        conn.close()


def _ask(conn: _socket.socket, flags: dict, listener: _socket.socket) -> tuple[int, int]:
    conn.settimeout(REPLY_WAIT)
    server, uid, _ = peer(conn)
    if uid != 0:
        raise ForkServerError(f"the fork server's socket is held by uid {uid}, not root")
    with open("/proc/self/cmdline", "rb") as f:
        cmdline = f.read()
    request = lightjson.dumps({"flags": flags, "env": dict(os.environ),
                          "cmdline": cmdline.decode("latin-1")}).encode()
    here = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        conn.sendmsg([request], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS,
                                  struct.pack("2i", listener.fileno(), here))])
    finally:
        os.close(here)
    reply = conn.recv(MAX_MESSAGE)
    if not reply:
        raise ForkServerError("the fork server closed the connection without an answer")
    try:
        answer = lightjson.loads(reply)
        pid = answer.get("pid")
    except (ValueError, AttributeError):
        raise ForkServerError(f"the fork server's answer is not one: {reply[:200]!r}") from None
    if not isinstance(pid, int) or pid <= 0:
        raise ForkServerError(f"the fork server gave no daemon: {answer.get('error', answer)}")
    conn.sendall(GO)
    return pid, server


SERVER_MODULE = "shim.contract.forkserver"


def spawn_server() -> None:
    """Start the fork server of this code, detached; return at once. A new interpreter
    (posix_spawn, no fork of `start`: a forked copy would share `start`'s pages with the
    daemon `start` forks next, and its every write would copy them), in its own session,
    stdio on /dev/null, spawned before `start` leaves the host's mount namespace for the
    pod's, so that the server and its daemons are where `start`'s own daemon is."""
    # -P: not the working directory (the bundle) on sys.path, as it would be with -m
    argv = [sys.executable, *(["-I"] if sys.flags.isolated else []), "-P", "-m",
            SERVER_MODULE]
    os.posix_spawn(sys.executable, argv, os.environ,
                   file_actions=[(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDWR, 0),
                                 (os.POSIX_SPAWN_DUP2, 0, 1), (os.POSIX_SPAWN_DUP2, 0, 2)],
                   setsid=True)


def note(bundle: str, message: str) -> None:
    """A warning line for containerd's log (`<bundle>/log`, the FIFO it reads the shim's
    log from): `start`'s stdout and stderr are containerd's answer, never a log."""
    text = message.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    now = time.time()
    when = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1000):03d}Z"
    line = (f'time="{when}" level=warning msg="{text}" runtime=io.containerd.podvm.v2\n'
            .encode("utf-8", "replace"))
    try:
        fd = os.open(os.path.join(bundle, "log"),
                     os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.write(fd, line)
    except OSError:
        pass
    finally:
        os.close(fd)


def server_pid(identity: str, where: str | None = None) -> int | None:
    """The pid of the fork server of `identity` listening now, else None (for operators,
    benchmarks and tests: the connection asks nothing and is refused)."""
    conn = _seqpacket()
    try:
        conn.connect(socket_path(identity, where))
        return peer(conn)[0]
    except OSError:
        return None
    finally:
        conn.close()
