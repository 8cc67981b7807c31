"""The pod's namespace holder: PID 1 of the pod's pid namespace, owner of its ipc and uts
namespaces, and reaper of the pod's orphans. It stands in for the CRI sandbox (pause)
container, which runs nothing else (starting it through runc costs over a second under
TCG), and holds the namespaces of a pod made through the Sandbox API, which has none.

busybox `unshare --fork` makes the namespaces and forks a shell into them; the shell
says it is up (a byte on a pipe), reads the pod's hostname from another, sets it in its
new uts namespace and only then says it is ready (a second byte), so that no container
joins it unnamed; then it waits in a loop, so orphans reparented to it are reaped, and
exits on SIGTERM/SIGINT. The pod's sysctls are set in its namespaces then too
(sysctls.py), before any container starts.

One holder is spawned ahead, as the agent starts (`prepare`), and waits for its
hostname: a template's guest holds it in its memory, so a restored guest spawns no
process for its pod's namespaces (two execs under TCG took a fifth of a restored pod's
start); a booted guest spawns it while it boots. A pod that needs another (its first
holder gone) gets one spawned then."""
from __future__ import annotations

import asyncio
import dataclasses
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
# A byte on READY_FD when up; the hostname on stdin, one line ("": keep the guest's), set
# by the shell's own write to its uts namespace's /proc/sys/kernel/hostname (no process);
# a second byte once named. The sleep it waits on (so that it reaps the pod's orphans) is
# started first, without the pipes: a template's holder has it, so a restored guest's pod
# is named with no fork and exec beside the agent's answer. The shell closes both pipes
# before it starts anything else.
SCRIPT = (f"trap 'exit 0' TERM INT; {BUSYBOX} sleep 2147483647 {READY_FD}>&- </dev/null & "
          f"echo >&{READY_FD}; IFS= read -r name || exit 1; "
          f"[ -z \"$name\" ] || echo \"$name\" > /proc/sys/kernel/hostname || exit 1; "
          f"echo >&{READY_FD}; exec {READY_FD}>&- 0</dev/null; "
          f"while :; do wait; {BUSYBOX} sleep 2147483647 & done")
CGROUP = "/sys/fs/cgroup/podvm"
HOST_NAME_MAX = 64
# unshare forks the holder's shell at once, but under TCG on a crowded host that fork can
# take seconds; its own exit ends the wait sooner.
START_TIMEOUT = 30


@dataclasses.dataclass
class _Spawned:
    """A holder up and waiting for its hostname."""
    parent: int
    """unshare's pid; the holder is its one child."""
    name: int
    """Where its hostname is written."""
    ready: int
    """Where it says it is named."""
    exit_watch: asyncio.Future[int]

    def discard(self) -> None:
        for fd in (self.name, self.ready):
            os.close(fd)
        try:
            os.kill(self.parent, 9)  # reaped by its exit watch
        except ProcessLookupError:
            pass


_ahead: _Spawned | None = None


async def prepare() -> None:
    """The holder spawned ahead of any pod (at the agent's start); a failure is said and
    leaves pods to spawn theirs."""
    global _ahead
    try:
        _ahead = await _spawn_up()
    except (OSError, TtrpcError) as exc:
        log.warning("no namespace holder spawned ahead: %s", exc)


def _take_ahead() -> _Spawned | None:
    """The holder spawned ahead, if it is still up; then it is no one else's."""
    global _ahead
    spawned, _ahead = _ahead, None
    if spawned is not None and spawned.exit_watch.done():
        log.warning("the namespace holder spawned ahead exited (status %d)",
                    spawned.exit_watch.result())
        spawned.discard()
        return None
    return spawned


async def start(container_id: str, hostname: str = "",
                sysctls: Mapping[str, str] | None = None) -> Process:
    """The holder, running, as the init process of `container_id` (in its own cgroup
    /podvm/<id>, so that stats, pause and removal work as for any container), with
    `hostname` in its uts namespace ("": the guest's) and `sysctls` set. Its state is
    still created: StartContainer moves it on as it would a runc container. A holder
    whose hostname or sysctls fail is killed."""
    if len(hostname.encode()) > HOST_NAME_MAX or "\0" in hostname or "\n" in hostname:
        raise TtrpcError(Code.INVALID_ARGUMENT, f"pod {container_id}: hostname {hostname!r} "
                         f"is not a hostname (at most {HOST_NAME_MAX} bytes, one line)")
    spawned = _take_ahead() or await _spawn_up()
    proc = Process(container_id, "")
    _report_exit(spawned.exit_watch, proc)
    await _name(container_id, hostname, spawned, proc)
    with open(f"/proc/{spawned.parent}/task/{spawned.parent}/children") as f:
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


async def _spawn_up() -> _Spawned:
    """unshare running the holder's shell, up and waiting for its hostname."""
    argv = ["unshare", "--fork", "--pid", "--ipc", "--uts", "--", BUSYBOX, "sh", "-c", SCRIPT,
            "holder"]
    # posix_spawn's dup2 clears close-on-exec even where a pipe's end already is the fd
    ready, ready_w = os.pipe()
    name_r, name = os.pipe()
    try:
        parent = os.posix_spawn(BUSYBOX, argv, {"PATH": "/bin"},
                                file_actions=[(os.POSIX_SPAWN_DUP2, ready_w, READY_FD),
                                              (os.POSIX_SPAWN_DUP2, name_r, 0)])
    except BaseException:
        for fd in (ready, name):
            os.close(fd)
        raise
    finally:
        os.close(ready_w)
        os.close(name_r)
    spawned = _Spawned(parent, name, ready, REAPER.watch(parent))
    said = await _byte_in_time(spawned)
    if not said:
        status = await spawned.exit_watch if said is not None else None
        spawned.discard()
        raise TtrpcError(Code.INTERNAL, "the namespace holder " + (
            f"exited at its start (status {status})" if said is not None else
            f"did not start within {START_TIMEOUT} s"))
    return spawned


async def _byte_in_time(spawned: _Spawned) -> bytes | None:
    """The holder's next byte; b"" when it closed the pipe (it exited), None when it
    said nothing within START_TIMEOUT."""
    try:
        return await asyncio.wait_for(_read_byte(spawned.ready), START_TIMEOUT)
    except asyncio.TimeoutError:
        return None


def _report_exit(exit_watch: asyncio.Future[int], proc: Process) -> None:
    """unshare's exit, recorded as `proc`'s."""
    def exited(future: asyncio.Future[int]) -> None:
        # unshare outlives the shell by a moment and passes its status on; a signal the
        # agent sent is reported as runc's shim would (128 + n).
        status = future.result()
        proc.set_exited(128 + proc.killed_by if proc.killed_by else status, time.time_ns())

    exit_watch.add_done_callback(exited)


async def _name(container_id: str, hostname: str, spawned: _Spawned, proc: Process) -> None:
    """The holder named `hostname`, and the pipes to it closed; a holder that does not
    say so in time is killed, one that exits first is said why."""
    try:
        os.write(spawned.name, f"{hostname}\n".encode())
    except BrokenPipeError:
        pass  # it exited: the ready pipe says so
    finally:
        os.close(spawned.name)
    try:
        said = await _byte_in_time(spawned)
    finally:
        os.close(spawned.ready)
    if said is None:
        try:
            os.kill(spawned.parent, 9)  # its exit is reaped by its exit watch
        except ProcessLookupError:
            pass
        raise TtrpcError(Code.INTERNAL, f"the namespace holder of {container_id} was not "
                         f"named within {START_TIMEOUT} s")
    if not said:  # the pipe closed unwritten: the holder exited
        await spawned.exit_watch
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
