"""The pod's namespace holder: PID 1 of the pod's pid namespace, owner of its ipc and uts
namespaces, and reaper of the pod's orphans. It stands in for the CRI sandbox (pause)
container, which runs nothing else (starting it through runc costs over a second under
TCG), and holds the namespaces of a pod made through the Sandbox API, which has none.

busybox `unshare --fork` makes the namespaces and forks a shell into them; the shell
waits in a loop, so orphans reparented to it are reaped, and exits on SIGTERM/SIGINT.
Given a hostname (the pod's), the shell sets it in its new uts namespace first and only
then says it is ready (a byte on a pipe), so that no container joins it unnamed; the
pod's sysctls are set in its namespaces then too (sysctls.py), before any container
starts."""
from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Mapping

from podvm_core.ttrpc import Code, TtrpcError

from . import sysctls as pod_sysctls

from .containers import Process
from .reaper import REAPER

log = logging.getLogger("podvm.agent")

BUSYBOX = "/bin/busybox"
READY_FD = 3
# $1: the hostname, or "" to keep the guest's. The byte on READY_FD says the holder is
# there and named; the shell closes the pipe before anything inherits it.
SCRIPT = (f"trap 'exit 0' TERM INT; [ -z \"$1\" ] || {BUSYBOX} hostname \"$1\" || exit 1; "
          f"echo >&{READY_FD}; exec {READY_FD}>&-; "
          f"while :; do {BUSYBOX} sleep 2147483647 & wait; done")
CGROUP = "/sys/fs/cgroup/podvm"
HOST_NAME_MAX = 64
# unshare forks the holder's shell at once, but under TCG on a crowded host that fork can
# take seconds; its own exit ends the wait sooner.
START_TIMEOUT = 30


async def start(container_id: str, hostname: str = "",
                sysctls: Mapping[str, str] | None = None) -> Process:
    """The holder, running, as the init process of `container_id` (in its own cgroup
    /podvm/<id>, so that stats, pause and removal work as for any container), with
    `hostname` in its uts namespace ("": the guest's) and `sysctls` set. Its state is
    still created: StartContainer moves it on as it would a runc container. A holder
    whose hostname or sysctls fail is killed."""
    if len(hostname.encode()) > HOST_NAME_MAX or "\0" in hostname:
        raise TtrpcError(Code.INVALID_ARGUMENT, f"pod {container_id}: hostname {hostname!r} "
                         f"is not a hostname (at most {HOST_NAME_MAX} bytes)")
    parent, ready = _spawn(hostname)
    proc = Process(container_id, "")
    exit_watch = _watch_exit(parent, proc)
    await _wait_ready(container_id, hostname, parent, ready, proc, exit_watch)
    with open(f"/proc/{parent}/task/{parent}/children") as f:
        proc.pid = int(f.read().split()[0])
    _own_cgroup(container_id, proc.pid)
    if sysctls:
        try:
            await pod_sysctls.apply(proc.pid, sysctls, f"pod {container_id}")
        except BaseException:
            signal(proc, 9)
            raise
    log.info("pod namespaces for %s held by %d", container_id, proc.pid)
    return proc


def _spawn(hostname: str) -> tuple[int, int]:
    """unshare running the holder's shell: its pid, and the read end of the pipe the
    shell says it is ready on."""
    argv = ["unshare", "--fork", "--pid", "--ipc", "--uts", "--", BUSYBOX, "sh", "-c", SCRIPT,
            "holder", hostname]
    # posix_spawn's dup2 clears close-on-exec even where the pipe's end already is fd 3
    ready, ready_w = os.pipe()
    try:
        parent = os.posix_spawn(BUSYBOX, argv, {"PATH": "/bin"},
                                file_actions=[(os.POSIX_SPAWN_DUP2, ready_w, READY_FD)])
    except BaseException:
        os.close(ready)
        raise
    finally:
        os.close(ready_w)
    return parent, ready


def _watch_exit(parent: int, proc: Process) -> asyncio.Future[int]:
    """unshare's exit, reaped and recorded as `proc`'s."""
    def exited(future: asyncio.Future[int]) -> None:
        # unshare outlives the shell by a moment and passes its status on; a signal the
        # agent sent is reported as runc's shim would (128 + n).
        status = future.result()
        proc.set_exited(128 + proc.killed_by if proc.killed_by else status, time.time_ns())

    exit_watch = REAPER.watch(parent)
    exit_watch.add_done_callback(exited)
    return exit_watch


async def _wait_ready(container_id: str, hostname: str, parent: int, ready: int,
                      proc: Process, exit_watch: asyncio.Future[int]) -> None:
    """Until the holder says it is there and named (closing `ready`); a holder that
    does not in time is killed, one that exits first is said why."""
    try:
        said = await asyncio.wait_for(_read_byte(ready), START_TIMEOUT)
    except asyncio.TimeoutError:
        said = None
    finally:
        os.close(ready)
    if said is None:
        try:
            os.kill(parent, 9)  # its exit is reaped by _watch_exit's watch
        except ProcessLookupError:
            pass
        raise TtrpcError(Code.INTERNAL, f"the namespace holder of {container_id} did not "
                         f"start within {START_TIMEOUT} s")
    if not said:  # the pipe closed unwritten: the holder exited
        await exit_watch
        if hostname:
            raise TtrpcError(Code.INVALID_ARGUMENT, f"pod {container_id}: cannot set the "
                             f"hostname {hostname!r} (the holder exited with status "
                             f"{proc.exit_status})")
        raise TtrpcError(Code.INTERNAL, f"the namespace holder of {container_id} exited "
                         f"before it held anything (status {proc.exit_status})")


async def _read_byte(fd: int) -> bytes:
    """One byte from the pipe `fd` when it comes; b"" when its writers are all gone."""
    loop = asyncio.get_running_loop()
    got: asyncio.Future[bytes] = loop.create_future()

    def readable() -> None:
        if not got.done():
            got.set_result(os.read(fd, 1))

    loop.add_reader(fd, readable)
    try:
        return await got
    finally:
        loop.remove_reader(fd)


def signal(proc: Process, signum: int) -> None:
    proc.killed_by = signum
    os.kill(proc.pid, signum)


def cgroup_dir(container_id: str) -> str:
    return os.path.join(CGROUP, container_id)


def _own_cgroup(container_id: str, pid: int) -> None:
    try:
        os.makedirs(cgroup_dir(container_id), exist_ok=True)
        with open(os.path.join(CGROUP, "cgroup.subtree_control"), "w") as f:
            f.write("+cpu +cpuset +memory +pids +io")  # as runc would, for the stats
        with open(os.path.join(cgroup_dir(container_id), "cgroup.procs"), "w") as f:
            f.write(str(pid))
    except OSError as exc:
        log.warning("holder %d of %s stays outside its cgroup: %s", pid, container_id, exc)


def remove_cgroup(container_id: str) -> None:
    try:
        os.rmdir(cgroup_dir(container_id))
    except OSError:
        pass
