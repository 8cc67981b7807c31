"""The shim process contract's `start`: find or spawn the pod's daemon (`delete`: delete.py).

`start` sits on containerd's critical path for every container, so this module only
imports the standard library's light parts; the daemon loads the rest after it detaches.
"""
from __future__ import annotations

import errno
import os
import select
import _socket  # not socket.py: its enums and selectors are 4 ms of every `start`
import stat
import sys
import time

from podvm_core import trees
from podvm_core.atomic import write_atomic

from ..host import paths, shimstate
from . import bootstrap, forkclient, identity
from .flags import Flags

TYPE_CHECKING = False  # not typing's: typing is 4 ms of every `start`
if TYPE_CHECKING:
    import socket
    from collections.abc import Callable  # collections: 2 ms of every `start`


def start(flags: Flags, serve: Callable[[Flags, "socket.socket"], int]) -> int:
    """`serve(flags, sock)`: what the forked daemon runs (the CLI passes it in, so that
    this module never imports the daemon's side)."""
    bundle = flags.bundle_dir
    stdin = _keep_runtime_options(bundle)
    group = paths.group_id(paths.read_spec(bundle), flags.id)
    address = paths.socket_address(flags.address, flags.namespace, group)
    sock = _bind(paths.socket_path(address))
    if sock is None:  # the pod's daemon is alive and serves this container too
        _write_tree(bundle, (shimstate.read(flags.namespace, group) or {}).get("tree"))
        _write_address(bundle, address)
        sys.stdout.buffer.write(bootstrap.answer(stdin, address))
        return 0
    daemon_flags = flags._replace(bundle=bundle, socket=address, action="serve")
    try:
        pid, server = _daemon(daemon_flags, sock, serve)
    except BaseException:
        sock.close()
        os.unlink(paths.socket_path(address))
        raise
    sock.close()
    tree = trees.own()
    state = {"pid": pid, "address": address, "bundle": bundle, "id": flags.id, "tree": tree}
    if server:
        state["forkserver"] = server
    shimstate.write(flags.namespace, group, state)
    _write_tree(bundle, tree)
    _write_address(bundle, address)
    sys.stdout.buffer.write(bootstrap.answer(stdin, address))
    return 0


STDIN_WAIT = 0.2
"""Seconds `start` waits for stdin to have data or end; containerd's is written and
closed at once, so only a stdin that is not containerd's waits this long."""


def _keep_runtime_options(bundle: str) -> bytes:
    """containerd writes the runtime's options (runtimeoptions.v1.Options in an Any, with
    the ConfigPath) to `start`'s stdin, bare before 2.3, inside its BootstrapParams from
    2.3: the Sandbox API gets them nowhere else (the Task API with each Create). Kept
    unparsed in the bundle, as runc's shim keeps its own (options.json): decoding needs
    protobuf, which `start` does not load. Returns stdin, which also says how to answer
    (bootstrap.py)."""
    data = _read_stdin()
    if data:
        write_atomic(os.path.join(bundle, paths.RUNTIME_OPTIONS_FILE), data)
    return data


def _read_stdin() -> bytes:
    """All of stdin when it is a pipe or a file (what containerd gives); nothing from a
    terminal or /dev/null, and no waiting on a pipe that no one writes nor closes."""
    try:
        mode = os.fstat(0).st_mode
    except OSError:
        return b""
    if not (stat.S_ISFIFO(mode) or stat.S_ISREG(mode)):
        return b""
    chunks = []
    deadline = time.monotonic() + STDIN_WAIT
    while select.select([0], [], [], max(0.0, deadline - time.monotonic()))[0]:
        chunk = os.read(0, 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def _bind(path: str) -> _socket.socket | None:
    """A listening socket at `path`, or None when a live daemon already listens there."""
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        sock.bind(path)
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            sock.close()
            raise
        if _accepts(path):
            sock.close()
            return None
        os.unlink(path)  # stale: its daemon died without cleaning up
        sock.bind(path)
    os.chmod(path, 0o600)
    sock.listen(128)
    return sock


def _accepts(path: str) -> bool:
    probe = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        probe.connect(path)
        return True
    except OSError:
        return False
    finally:
        probe.close()


def _daemon(daemon_flags: Flags, sock: _socket.socket,
            serve: Callable[[Flags, "socket.socket"], int]) -> tuple[int, int]:
    """The daemon's pid and the fork server's that forked it (0: this `start` forked it).
    From the fork server of this code (forkserver.py) when one serves; else forked here,
    as before there was one, and the server spawned for the next `start`s."""
    try:
        served = forkclient.request_daemon(identity.own_name(), daemon_flags._asdict(), sock)
        if served is not None:
            return served
        forkclient.spawn_server()
    except Exception as exc:  # any error: served as without a server, and said why
        forkclient.note(daemon_flags.bundle, f"start forks the daemon itself: {exc}")
    return _spawn_daemon(daemon_flags, sock, serve), 0


def _spawn_daemon(daemon_flags: Flags, sock: _socket.socket,
                  serve: Callable[[Flags, "socket.socket"], int]) -> int:
    """The daemon: a fork of this process, so that it starts with the interpreter and
    what `start` imported already loaded (containerd connects as soon as `start` returns:
    a fresh interpreter would answer tens of ms later). Own session and process group,
    not holding containerd's pipes (stdio is /dev/null until it opens the log FIFO). In
    the pod's own mount namespace (shim/host/mountns.py), which `start` makes and the daemon
    inherits: made here, its failure is `start`'s, which containerd reports."""
    # Here, not at the top: only a `start` that forks a daemon needs it (ctypes).
    from ..host.mountns import unshare_for_pod

    unshare_for_pod()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        os.setsid()
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        os.close(devnull)
        # Here, not at the top: the daemon's, which serves on a socket.socket
        import socket

        code = serve(daemon_flags, socket.socket(fileno=sock.detach()))
    finally:
        os._exit(code)  # never back into `start`: its caller's cleanup is not ours


def _write_tree(bundle: str, tree: str | None) -> None:
    """Which installed tree serves the container (podvm_core/trees.py): its `delete` runs
    that tree's shim, whatever /opt/podvm/current is by then."""
    if tree:
        write_atomic(os.path.join(bundle, trees.TREE_FILE), tree.encode())


def _write_address(bundle: str, address: str) -> None:
    write_atomic(os.path.join(bundle, "address"), address.encode())
