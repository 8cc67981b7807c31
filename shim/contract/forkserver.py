"""The fork server: a warm parent per code identity (identity.py), from which `start`
gets the pod's daemon already holding the interpreter, asyncio, protobuf and the Task
API's messages, which every first answer needs and which a fresh process takes ~100 ms
of CPU to load (docs/design.md, "The fork server").

It is forked off a `start` that containerd ran (forkclient.spawn_server), so it lives
where that `start`'s daemon would: containerd's cgroup, the host's namespaces, its
limits; a request from a process elsewhere (another cgroup or namespace) is refused,
and so is one from a peer that is not root (SO_PEERCRED). It never runs an event loop
nor a thread (each daemon makes its own loop, and unshare(2) needs one thread). It goes
once it has forked nothing for IDLE_EXIT seconds and no daemon it forked still runs, or
when its code is no longer what a new `start` runs (an upgrade, an edit), so that the
tree collector can remove an old tree. While its pods run it stays, with its worker
parent (workerparent.py): their removal forks their network workers loaded, however long
ago they started, and a pod started after a lull is forked warm."""
from __future__ import annotations

import contextlib
import fcntl
import gc
import json
import os
import select
import signal
import socket
import stat
import struct
import time

from podvm_core import trees

from ..host.pids import start_time
from . import forkchild, identity as code_identity
from .workerparent import DELAY as PARENT_DELAY, WorkerParent
from .flags import Flags
from .forkclient import MAX_MESSAGE, directory, lock_path, peer, socket_path
from .proctitle import set_cmdline

IDLE_EXIT = 600.0
"""Seconds without a request, and without a daemon of its own running, after which the
server exits (a node that runs no pod of its code keeps no warm parent)."""
TEST_IDLE_ENV = "PODVM_TEST_FORKSERVER_IDLE"
"""Tests only: a shorter idle time, in seconds (at least 0.2)."""
CHECK_EVERY = 5.0
"""Seconds between checks that the server's code is still current (a readlink in a
tree; 0.6 ms of hashing in a checkout)."""
WARM_DELAY = 1.0
"""Seconds the server waits before it loads: the daemon of the `start` that spawned it
starts meanwhile, as if there were no server (on a node's first pod, a reboot, an
upgrade), without the server's ~100 ms of loading beside it."""
REQUEST_WAIT = 2.0
"""Seconds a peer has to send its request once connected."""


class Refused(Exception):
    """A request the server will not serve: the message says why (sent to the peer)."""


class _Stop(BaseException):
    pass


def main() -> int:
    """`python -m shim.contract.forkserver`, as forkclient.spawn_server runs it."""
    from .cli import load_daemon, load_pod, run_daemon  # here: for `-m` alone

    def load() -> None:
        load_daemon()
        load_pod()

    code = code_identity.own()
    return run(code, code_identity.name(code, code_identity.place()), run_daemon, load)


def run(code: str, identity: str, serve, load) -> int:
    """The server's life, as `identity` (its code's and place's name): `serve(flags,
    sock)` runs each daemon, `load()` loads what they need first."""
    _detach()
    where = directory()
    try:
        _own_directory(where)
        lock = _take_lock(identity, where)
    except OSError:
        return 1
    if lock is None:
        return 0  # another server of this identity lives (or is starting)
    signal.signal(signal.SIGTERM, _stop)
    listener = None
    workers = WorkerParent()
    try:
        policy = os.sched_getscheduler(0)
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # while it loads
        time.sleep(WARM_DELAY)
        set_cmdline(f"containerd-shim-podvm-v2\0forkserver\0{socket_path(identity, where)}\0"
                    .encode(), b"")
        load()  # what every daemon's first answer needs, and its pod's first Create
        gc.freeze()
        gc.enable()
        # the daemons run as `start` does (failing that, the server goes: never a daemon
        # of a lower class)
        os.sched_setscheduler(0, policy, os.sched_param(0))
        if not code_identity.current(code):
            return 0  # changed while it loaded: a newer server will be spawned
        listener = _listen(socket_path(identity, where))
        workers.ensure()
        _loop(listener, code, serve, _idle_exit(), workers)
    except _Stop:
        pass
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        workers.close()
        for path in (socket_path(identity, where), lock_path(identity, where)):
            try:
                os.unlink(path)  # under the lock: no other server uses these names now
            except OSError:
                pass
        if listener is not None:
            listener.close()
        os.close(lock)
    if trees.own() is not None and trees.retired():
        # after an uninstall: the tree may have no other process left (as a daemon's exit)
        from podvm_core.treegc import collect_retired_own

        collect_retired_own()
    return 0


def _stop(signum, frame) -> None:
    raise _Stop()


def _detach() -> None:
    """Own session, out of the bundle, holding none of `start`'s descriptors (containerd
    reads `start`'s output until every copy of its pipes is closed)."""
    if os.getsid(0) != os.getpid():
        os.setsid()
    os.chdir("/")
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))  # devnull's own included


def _idle_exit() -> float:
    try:
        return max(0.2, float(os.environ[TEST_IDLE_ENV]))
    except (KeyError, ValueError):
        return IDLE_EXIT


def _own_directory(where: str) -> None:
    """The servers' directory, root's and 0700, refused as anything else."""
    os.makedirs(where, mode=0o700, exist_ok=True)
    st = os.lstat(where)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0 or stat.S_IMODE(st.st_mode) & 0o077:
        raise PermissionError(f"{where} is not a directory of root's alone")


def _take_lock(identity: str, where: str) -> int | None:
    """The identity's lock (flock), held for the server's life; None when another holds
    it. A lock file unlinked by a server on its way out is not the lock any longer."""
    while True:
        fd = os.open(lock_path(identity, where),
                     os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        try:
            same = os.stat(lock_path(identity, where), follow_symlinks=False).st_ino == \
                os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)


def _listen(path: str) -> socket.socket:
    try:
        os.unlink(path)  # stale: a server that died (ours is the lock now)
    except FileNotFoundError:
        pass
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    listener.bind(path)
    os.chmod(path, 0o600)
    listener.listen(64)
    listener.setblocking(False)
    return listener


class Daemons:
    """The daemons this server forked, by pid, with the start time /proc gives each (a
    pid reused by another process is not one of them)."""

    def __init__(self) -> None:
        self._started: dict[int, int] = {}

    def add(self, pid: int) -> None:
        started = start_time(pid)
        if started is not None:
            self._started[pid] = started

    def running(self) -> bool:
        """Whether one still runs; those gone are forgotten."""
        self._started = {pid: started for pid, started in self._started.items()
                         if start_time(pid) == started}
        return bool(self._started)


def _loop(listener: socket.socket, code: str, serve, idle: float,
          workers: WorkerParent) -> None:
    last = checked = time.monotonic()
    daemons = Daemons()
    while True:
        now = time.monotonic()
        quiet = idle - (now - last)
        if quiet <= 0:
            if not daemons.running():
                return
            quiet = CHECK_EVERY  # idle, but serving its pods: asked again then
        if now - checked >= CHECK_EVERY:
            if not code_identity.current(code) or (
                    code.startswith("tree-") and trees.retired()):
                return
            checked = now
        wait = min(quiet, CHECK_EVERY - (now - checked))
        if workers.missing():
            if now - last >= PARENT_DELAY:
                workers.ensure()
            else:
                wait = min(wait, PARENT_DELAY - (now - last))
        if not select.select([listener], [], [], max(0.0, wait))[0]:
            continue
        try:
            conn, _ = listener.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            continue
        with conn:
            pid = _serve_one(conn, serve, workers)
        if pid is not None:
            daemons.add(pid)
        last = time.monotonic()


def _serve_one(conn: socket.socket, serve, workers: WorkerParent) -> int | None:
    """One request: a daemon forked (its pid), or a refusal sent (None); never a child
    left behind."""
    conn.setblocking(True)
    conn.settimeout(REQUEST_WAIT)
    fds: list[int] = []
    try:
        pid, uid, _ = peer(conn)
        if uid != 0:
            raise Refused(f"refused: the peer (pid {pid}) runs as uid {uid}, not root")
        data, fds, msg_flags, _ = socket.recv_fds(conn, MAX_MESSAGE, 4)
        if msg_flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
            raise Refused("refused: the request was truncated")
        request = _request(data, fds)
        _same_place(pid)
        try:
            return _fork(conn, request, fds, serve, workers.fd())
        finally:
            for fd in fds:
                os.close(fd)
            fds = []
    except Refused as exc:
        _answer(conn, {"error": str(exc)})
    except OSError as exc:  # the peer went away, or a fork failed
        _answer(conn, {"error": f"the fork server failed: {exc}"})
    finally:
        for fd in fds:
            os.close(fd)
    return None


def _answer(conn: socket.socket, answer: dict) -> None:
    try:
        conn.send(json.dumps(answer).encode())
    except OSError:
        pass


def _request(data: bytes, fds: list[int]) -> forkchild.Request:
    if len(fds) != 2:
        raise Refused(f"refused: a request brings 2 descriptors, not {len(fds)}")
    try:
        body = json.loads(data)
        flags, env, cmdline = body["flags"], body["env"], body["cmdline"]
    except (ValueError, TypeError, KeyError) as exc:
        raise Refused(f"refused: the request is not one: {exc!r}") from None
    if not (isinstance(flags, dict) and set(flags) == set(Flags._fields) and
            all(isinstance(flags[k], type(d)) for k, d in zip(Flags._fields,
                                                              Flags._field_defaults.values()))):
        raise Refused("refused: the request's flags are not the shim's")
    if not (isinstance(env, dict) and
            all(isinstance(k, str) and isinstance(v, str) and k and "=" not in k and
                "\0" not in k + v for k, v in env.items())):
        raise Refused("refused: the request's environment is not one")
    if not isinstance(cmdline, str) or not cmdline.endswith("\0"):
        raise Refused("refused: the request's command line is not one")
    if not stat.S_ISSOCK(os.fstat(fds[0]).st_mode) or not stat.S_ISDIR(os.fstat(fds[1]).st_mode):
        raise Refused("refused: a request brings a socket and a directory")
    return forkchild.Request(Flags(**flags), env, cmdline.encode("latin-1"))


def _same_place(pid: int) -> None:
    """The daemon gets what `start` would have given it: the server serves a `start` of
    its own place (identity.place) and no other."""
    theirs, ours = code_identity.place(pid), code_identity.place()
    for key in ours:
        if theirs.get(key) != ours[key]:
            raise Refused(f"refused: `start` (pid {pid}) differs from the server in {key}")


def _fork(conn: socket.socket, request: forkchild.Request, fds: list[int], serve,
          workers_fd: int) -> int | None:
    """The daemon, a grandchild: its parent exits at once, so that (as a daemon `start`
    forks) it is nobody's child here and the server holds no child. Its pid, as its
    parent tells it; None when there is none."""
    said, tell = os.pipe2(os.O_CLOEXEC)  # the daemon closes both (forkchild._take)
    try:
        middle = os.fork()
        if middle == 0:
            code = 1
            try:
                pid = os.fork()
                if pid == 0:
                    forkchild.become_daemon(conn, request, fds[0], fds[1], serve,
                                            workers_fd)  # never returns
                code = 0
                with contextlib.suppress(OSError):
                    os.write(tell, struct.pack("=i", pid))
            except BaseException as exc:
                _answer(conn, {"error": f"the fork server could not fork: {exc}"})
            finally:
                os._exit(code)
        os.close(tell)
        tell = -1
        os.waitpid(middle, 0)
        told = os.read(said, 4)
        return struct.unpack("=i", told)[0] if len(told) == 4 else None
    finally:
        os.close(said)
        if tell >= 0:
            os.close(tell)


if __name__ == "__main__":
    raise SystemExit(main())
