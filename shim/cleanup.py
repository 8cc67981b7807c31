"""Removing what a shim made, from persisted state alone (the daemon may be dead)."""
from __future__ import annotations

import logging
import os
import signal
import time

from . import manager, paths
from .mounts import unmount, unmount_all

log = logging.getLogger("podvm.cleanup")



def remove_shim_state(namespace: str, group: str, address: str | None) -> None:
    """The daemon's socket, its VM and mounts, and its state directory; a no-op for what
    is already gone."""
    from .sandbox import cleanup_from_state, remove_tree

    if address:
        try:
            os.unlink(paths.socket_path(address))
        except FileNotFoundError:
            pass
    state_dir = paths.state_dir(namespace, group)
    cleanup_from_state(state_dir)
    # Shared parents (/run/podvm/<namespace>) stay: removing them would race with
    # another pod's `start` creating its directory there.
    remove_tree(state_dir)


def cleanup_container(namespace: str, container_id: str, bundle: str) -> None:
    group = paths.group_id(paths.read_spec(bundle), container_id)
    if group != container_id:  # a workload container: its own mounts only
        unmount_all(os.path.join(paths.state_dir(namespace, group), "shared", container_id))
        unmount(os.path.join(bundle, "rootfs"))
        return
    state = manager.read_state(namespace, group) or {}
    pid = state.get("pid")
    if isinstance(pid, int) and _is_our_shim(pid):
        log.info("killing shim daemon %d of sandbox %s", pid, group)
        kill_and_wait(pid)
    remove_shim_state(namespace, group, state.get("address"))
    unmount(os.path.join(bundle, "rootfs"))


def cmdline(pid: int) -> bytes:
    """The process's command line; empty when it is gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _is_our_shim(pid: int) -> bool:
    return b"containerd-shim-podvm-v2" in cmdline(pid)


def kill_and_wait(pid: int, timeout: float = 30.0) -> None:
    """SIGKILL `pid` and return once every thread of it has finished exiting, so that
    nothing of it is left in a cgroup (an exiting thread cannot be moved out, and a
    dying leader shows as a zombie while its other threads are still exiting). A VMM
    with a large address space can take seconds to exit on a busy machine."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    delay = 0.001
    while _alive(pid):
        if time.monotonic() >= deadline:
            log.warning("process %d still exiting %.0fs after SIGKILL", pid, timeout)
            return
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


def _alive(pid: int) -> bool:
    """Some thread of it has not finished exiting (a zombie leader alone is done: its
    parent may never reap it)."""
    try:
        threads = os.listdir(f"/proc/{pid}/task")
        if threads != [str(pid)]:
            return bool(threads)
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return False
