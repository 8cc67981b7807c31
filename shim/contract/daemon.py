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
from typing import Callable

from podvm_core.pb.containerd.task.v2 import shim_pb2
from podvm_core import trees
from podvm_core.ttrpc import Server, Service, bind

from ..api import errors
from . import log as shimlog
from ..host import paths, shimstate
from ..api.events import Publisher
from ..api.task.deferred import TaskAPI
from ..pod.podslot import PodSlot
from .flags import Flags

log = logging.getLogger("podvm.shim")

SOCKET_FD = 3
TASK_SERVICES = ("containerd.task.v2.Task", "containerd.task.v3.Task")
SANDBOX_SERVICE = "containerd.runtime.sandbox.v1.Sandbox"
HANGUP_GRACE = 1.0
"""Seconds the exiting daemon leaves containerd to hang up first, so that the answer to
its Shutdown or ShutdownSandbox is read as an answer (podvm_core/ttrpc/server.py)."""


def serve(flags: Flags, sock: socket.socket | None = None,
          worker_parent: socket.socket | None = None) -> int:
    """Serve on `sock` (`start` forks the daemon with the socket it bound), else on fd 3.
    `worker_parent`: the socket of the fork server's worker parent, when the server
    forked it."""
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
        asyncio.run(_serve(flags, sock, worker_parent))
    except Exception:
        log.exception("shim daemon failed")
        return 1
    finally:
        # after an uninstall under this pod: its tree goes with its last process
        # (`delete`, if containerd runs it, collects too)
        if trees.own() is not None and trees.retired():
            # Here, not at the top: after an uninstall only (shutil, off the daemon's start)
            from podvm_core.treegc import collect_retired_own

            collect_retired_own()
    return 0


async def _serve(flags: Flags, sock: socket.socket,
                 worker_parent: socket.socket | None) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    publisher = Publisher(flags.namespace, os.environ.get("TTRPC_ADDRESS", ""),
                          flags.publish_binary, flags.address)

    def shutdown() -> None:
        loop.call_soon(stop.set)

    # The one pod, shared by both APIs (shim/pod/podslot.py).
    slot = PodSlot(worker_parent)
    tasks = TaskAPI(flags.namespace, publisher, shutdown, slot)
    descriptor = shim_pb2.DESCRIPTOR.services_by_name["Task"]
    server = Server([tasks.bind(descriptor, name) for name in TASK_SERVICES],
                    answer=errors.to_ttrpc)
    server.register_deferred(SANDBOX_SERVICE,
                             lambda: _sandbox_service(slot, flags.namespace, shutdown))
    await server.start(sock)
    # Serving: collect garbage again (`cli` stops it while the daemon starts), leaving out
    # what starting made, which lives as long as the daemon.
    gc.freeze()
    gc.enable()
    log.info("serving %s and %s on %s (pid %d, mount namespace %s)", "/".join(TASK_SERVICES),
             SANDBOX_SERVICE, flags.socket, os.getpid(), os.readlink("/proc/self/ns/mnt"))
    await _start_network_worker(slot, flags.bundle_dir)
    started = time.monotonic()
    await stop.wait()
    log.info("shim exiting after %.1fs", time.monotonic() - started)
    await server.close(grace=HANGUP_GRACE)
    await tasks.close()
    await slot.close()
    await publisher.close()
    group = paths.group_id(paths.read_spec(flags.bundle_dir), flags.id)
    owner = (shimstate.read(flags.namespace, group) or {}).get("pid")
    if owner not in (None, os.getpid()):
        # A new daemon for the same id (started after this one was given up for dead)
        # owns the socket and the state directory now.
        log.info("state of %s now belongs to shim %s: leaving it", group, owner)
        return
    # Here, not at the top: psutil and the cgroup managers, for the way out only, would
    # grow every idle daemon.
    from ..host.cleanup import remove_shim_state

    remove_shim_state(flags.namespace, group, flags.socket)


async def _start_network_worker(slot: PodSlot, bundle: str) -> None:
    """The network worker for the pod whose sandbox container `start` came for, when its
    spec names the pod's network namespace: started now, while containerd has yet to
    send the Create that boots the pod, it is ready when the boot needs it
    (shim/network/ahead.py)."""
    # Here, not at the top: a daemon without a pod network has no use for it.
    from ..pod.hostns import spec_namespaces

    try:
        spec = paths.read_spec(bundle)
    except (OSError, ValueError):
        return  # the Sandbox API's bundle: CreateSandbox starts the pod's worker
    if isinstance(spec, dict) and spec_namespaces(spec).get("network"):
        await slot.network_worker.start()
    else:  # no pod network (the host's): a worker started ahead would wait for nothing
        await slot.network_worker.close()


def _sandbox_service(slot: PodSlot, namespace: str, shutdown: Callable[[], None]) -> Service:
    """The Sandbox API, made at its first call: only containerd 2.x with `sandboxer =
    "shim"` calls it, and its code and messages would grow every idle daemon."""
    # Both here, not at the top, for that reason.
    from podvm_core.pb.containerd.runtime.sandbox.v1 import sandbox_pb2

    from ..api.sandbox.service import SandboxService  # likewise

    impl = SandboxService(slot, namespace, shutdown)
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
