"""Removing what a shim made, from persisted state alone (the daemon may be dead)."""
from __future__ import annotations

import logging
import os

from . import paths, shimstate
from .mounts import unmount, unmount_all
from .processes import is_our_shim, kill_and_wait

log = logging.getLogger("podvm.cleanup")


def remove_shim_state(namespace: str, group: str, address: str | None) -> None:
    """The daemon's socket, its VM and mounts, and its state directory; a no-op for what
    is already gone."""
    from .sandbox import cleanup_from_state, remove_tree  # the VM machinery: only when needed

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
    state = shimstate.read(namespace, group) or {}
    pid = state.get("pid")
    if isinstance(pid, int) and is_our_shim(pid):
        log.info("killing shim daemon %d of sandbox %s", pid, group)
        kill_and_wait(pid)
    remove_shim_state(namespace, group, state.get("address"))
    unmount(os.path.join(bundle, "rootfs"))
