"""The shim daemon: serves the Task API for one pod on the socket `start` bound."""
from __future__ import annotations

import asyncio
import errno
import logging
import os
import signal
import socket
import sys
import time

from . import cleanup, errors, log as shimlog, manager, paths
from .events import Publisher
from .flags import Flags
from .pb.containerd.runtime.sandbox.v1 import sandbox_pb2
from .pb.containerd.task.v2 import shim_pb2
from .task.service import TaskService
from .ttrpc import Server, bind

log = logging.getLogger("podvm.shim")

SOCKET_FD = 3
TASK_SERVICES = ("containerd.task.v2.Task", "containerd.task.v3.Task")
SANDBOX_SERVICE = "containerd.runtime.sandbox.v1.Sandbox"


def serve(flags: Flags) -> int:
    _open_log_fifo(os.path.join(flags.bundle_dir, "log"))
    shimlog.setup(flags.debug, id=flags.id, namespace=flags.namespace)
    try:
        sock = socket.socket(fileno=SOCKET_FD)
    except OSError:
        log.error("no listening socket on fd %d: the daemon is started by `start`", SOCKET_FD)
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
    tasks = TaskService(flags.namespace, publisher, shutdown=lambda: loop.call_soon(stop.set))
    sandboxes = _OnFirstCall(lambda: _sandbox_service(tasks, lambda: loop.call_soon(stop.set)))
    descriptor = shim_pb2.DESCRIPTOR.services_by_name["Task"]
    server = Server([bind(descriptor, tasks, name=name) for name in TASK_SERVICES] + [
        bind(sandbox_pb2.DESCRIPTOR.services_by_name["Sandbox"], sandboxes)],
        answer=errors.to_ttrpc)
    await server.start(sock)
    log.info("serving %s and %s on %s (pid %d)", "/".join(TASK_SERVICES), SANDBOX_SERVICE,
             flags.socket, os.getpid())
    started = time.monotonic()
    await stop.wait()
    log.info("shim exiting after %.1fs", time.monotonic() - started)
    await server.close()
    await tasks.close()
    await publisher.close()
    group = paths.group_id(paths.read_spec(flags.bundle_dir), flags.id)
    owner = (manager.read_state(flags.namespace, group) or {}).get("pid")
    if owner not in (None, os.getpid()):
        # A new daemon for the same id (started after this one was given up for dead)
        # owns the socket and the state directory now.
        log.info("state of %s now belongs to shim %s: leaving it", group, owner)
        return
    cleanup.remove_shim_state(flags.namespace, group, flags.socket)


class _OnFirstCall:
    """Handlers made at the first call: most pods never use the Sandbox API, and an idle
    daemon should not carry its code (memory per pod)."""

    def __init__(self, factory) -> None:
        self._factory = factory
        self._impl = None

    def __getattr__(self, rpc: str):
        async def handler(request, ctx):
            if self._impl is None:
                self._impl = self._factory()
            return await getattr(self._impl, rpc)(request, ctx)

        return handler


def _sandbox_service(tasks: TaskService, shutdown):
    from .sandboxapi import SandboxService

    return SandboxService(tasks.slot, tasks.namespace, shutdown)


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
