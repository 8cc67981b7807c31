"""Removing what a shim made, from persisted state alone (the daemon may be dead)."""
from __future__ import annotations

import errno
import logging
import os
import shutil
import signal
import time

from . import manager, paths

log = logging.getLogger("podvm.cleanup")

_MNT_DETACH = 2


def unmount(path: str) -> bool:
    """Unmount `path` if something is mounted there; True when something was."""
    if not os.path.ismount(path):
        return False
    import ctypes  # rarely needed; kept out of the idle daemon

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.umount2(os.fsencode(path), _MNT_DETACH) != 0:
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOENT):
            raise OSError(err, f"umount {path}: {os.strerror(err)}")
    return True


def remove_shim_state(namespace: str, group: str, address: str | None) -> None:
    """The daemon's socket and state directory; a no-op when they are already gone."""
    if address:
        try:
            os.unlink(paths.socket_path(address))
        except FileNotFoundError:
            pass
    # Shared parents (/run/podvm/<namespace>) stay: removing them would race with
    # another pod's `start` creating its directory there.
    shutil.rmtree(paths.state_dir(namespace, group), ignore_errors=True)


def cleanup_container(namespace: str, container_id: str, bundle: str) -> None:
    unmount(os.path.join(bundle, "rootfs"))
    group = paths.group_id(paths.read_spec(bundle), container_id)
    if group != container_id:
        return  # a workload container: its pod's daemon owns everything else
    state = manager.read_state(namespace, group) or {}
    pid = state.get("pid")
    if isinstance(pid, int) and _is_our_shim(pid):
        log.info("killing shim daemon %d of sandbox %s", pid, group)
        _kill_and_wait(pid)
    remove_shim_state(namespace, group, state.get("address"))


def _is_our_shim(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"containerd-shim-podvm-v2" in f.read()
    except OSError:
        return False


def _kill_and_wait(pid: int, timeout: float = 5.0) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.01)


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting for its parent to reap it."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False
