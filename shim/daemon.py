"""The shim daemon: serves the Task API for one pod on the socket `start` bound."""
from __future__ import annotations

import asyncio
import errno
import gc
import logging
import os
import signal
import socket
import sys
import time

from podvm_core.pb.containerd.task.v2 import shim_pb2
from podvm_core.ttrpc import Server, Service, bind

from . import errors, log as shimlog, paths
from .events import Publisher
from .flags import Flags
from .task.service import TaskService

log = logging.getLogger("podvm.shim")

SOCKET_FD = 3
TASK_SERVICES = ("containerd.task.v2.Task", "containerd.task.v3.Task")
SANDBOX_SERVICE = "containerd.runtime.sandbox.v1.Sandbox"


def serve(flags: Flags, sock: socket.socket | None = None) -> int:
    """Serve on `sock` (`start` forks the daemon with the socket it bound), else on fd 3."""
    _open_log_fifo(os.path.join(flags.bundle_dir, "log"))
    shimlog.setup(flags.debug, id=flags.id, namespace=flags.namespace)
    if sock is None:
        try:
            sock = socket.socket(fileno=SOCKET_FD)
        except OSError:
            log.error("no listening socket on fd %d: the daemon is started by `start`",
                      SOCKET_FD)
            return 1
    try:
        asyncio.run(_serve(flags, sock))
    except Exception:
        log.exception("shim daemon failed")
        return 1
    return 0


async def _serve(flags: Flags, sock: socket.socket) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    publisher = Publisher(flags.namespace, os.environ.get("TTRPC_ADDRESS", ""),
                          flags.publish_binary, flags.address)

    def shutdown() -> None:
        loop.call_soon(stop.set)

    tasks = TaskService(flags.namespace, publisher, shutdown=shutdown)
    descriptor = shim_pb2.DESCRIPTOR.services_by_name["Task"]
    server = Server([bind(descriptor, tasks, name=name) for name in TASK_SERVICES],
                    answer=errors.to_ttrpc)
    server.register_deferred(SANDBOX_SERVICE, lambda: _sandbox_service(tasks, shutdown))
    await server.start(sock)
    # Serving: collect garbage again (`cli` stops it while the daemon starts), leaving out
    # what starting made, which lives as long as the daemon.
    gc.freeze()
    gc.enable()
    log.info("serving %s and %s on %s (pid %d)", "/".join(TASK_SERVICES), SANDBOX_SERVICE,
             flags.socket, os.getpid())
    started = time.monotonic()
    await stop.wait()
    log.info("shim exiting after %.1fs", time.monotonic() - started)
    await server.close()
    await tasks.close()
    await publisher.close()
    from . import cleanup, shimstate  # on the way out only: kept off the start path

    group = paths.group_id(paths.read_spec(flags.bundle_dir), flags.id)
    owner = (shimstate.read(flags.namespace, group) or {}).get("pid")
    if owner not in (None, os.getpid()):
        # A new daemon for the same id (started after this one was given up for dead)
        # owns the socket and the state directory now.
        log.info("state of %s now belongs to shim %s: leaving it", group, owner)
        return
    cleanup.remove_shim_state(flags.namespace, group, flags.socket)


def _sandbox_service(tasks: TaskService, shutdown) -> Service:
    """The Sandbox API, made at its first call: only containerd 2.x with `sandboxer =
    "shim"` calls it, and its code and messages would grow every idle daemon."""
    # Both here, at the first Sandbox call: off the start path, out of an idle daemon.
    from podvm_core.pb.containerd.runtime.sandbox.v1 import sandbox_pb2
    from .sandboxapi import SandboxService

    impl = SandboxService(tasks.slot, tasks.namespace, shutdown)
    return bind(sandbox_pb2.DESCRIPTOR.services_by_name["Sandbox"], impl)


def _open_log_fifo(path: str) -> None:
    """containerd reads `<bundle>/log` (a FIFO) into its own log: make it our stderr."""
    for _ in range(50):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            return
        except OSError as exc:
            if exc.errno != errno.ENXIO:  # ENXIO: containerd has not opened its end yet
                return
            time.sleep(0.02)
            continue
        os.set_blocking(fd, True)
        os.dup2(fd, 2)
        os.close(fd)
        sys.stderr = open(2, "w", buffering=1, closefd=False, errors="replace")
        return
