"""Removing what a shim made, from persisted state alone (the daemon may be dead): its
socket, its VM (found by the QMP socket on QEMU's command line), mounts and cgroups (from
sandbox.json), its state directory.

The pod's mounts are in its own mount namespace (shim/host/mountns.py), which lives as long as
a process of the pod does: `delete` unmounts inside it through the daemon or QEMU while
one lives; once none does, nothing is left to unmount."""
from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import time
from collections.abc import Iterator

import psutil

import cgroups
from . import jailids, mountns, paths, shimstate
from .leftovers import abandoned
from .mounts import mounts_under, unmount, unmount_all
from ..network.errors import NetworkError
from .podstate import CgroupState, PodState, PodStateError, state_path
from .pids import is_our_shim, start_time
from .processes import kill_and_wait

log = logging.getLogger("podvm.cleanup")


def remove_shim_state(namespace: str, group: str, address: str | None) -> None:
    """The daemon's socket, its VM and mounts, and its state directory; a no-op for what
    is already gone. A state file this podvm cannot read is kept, after what could be
    removed without it was, and its PodStateError raised."""
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
    state = shimstate.read(namespace, group) or {}
    pid = state.get("pid")
    daemon = pid if isinstance(pid, int) and is_our_shim(pid) else None
    if group != container_id:  # a workload container: its own mounts only
        state_dir = paths.state_dir(namespace, group)
        pod_process = pod_mount_process(([daemon] if daemon else []) +
                                        _qemus_of_state_dir(state_dir))
        unmount_in_pod([os.path.join(state_dir, "shared", container_id),
                        os.path.join(state_dir, "export", container_id),
                        os.path.join(bundle, "rootfs")], pod_process, group)
        return
    if daemon is not None:
        log.info("killing shim daemon %d of sandbox %s", daemon, group)
        kill_and_wait(daemon)
    with _claimed(paths.state_dir(namespace, group), wait=True):
        remove_shim_state(namespace, group, state.get("address"))
    unmount(os.path.join(bundle, "rootfs"))  # made in the host's namespace by an older podvm


def sweep_stale(namespace: str, deadline: float) -> list[str]:
    """Remove the state of the sandboxes in `namespace` whose daemon is gone and whose
    `delete` did not finish: containerd kills a `delete` at 5 s, which a loaded node can
    reach, and nothing else would ever remove its QEMU, cgroups and /run/podvm/<ns>/<id>.
    `delete` runs this after its own cleanup, so the next pod to go sweeps the state a
    killed one left. No new removal starts after `deadline` (time.monotonic()); what is
    left then waits for the next sweep. Returns the sandboxes swept."""
    try:
        groups = sorted(os.listdir(os.path.join(paths.STATE_ROOT, namespace)))
    except FileNotFoundError:
        return []
    swept = []
    for group in groups:
        if time.monotonic() > deadline:
            break
        state_dir = paths.state_dir(namespace, group)
        with _claimed(state_dir, wait=False) as ours:
            state = shimstate.read(namespace, group)
            if not ours or not abandoned(state_dir, state):
                continue
            log.info("sweeping the state of sandbox %s, whose shim is gone", group)
            try:
                remove_shim_state(namespace, group, (state or {}).get("address"))
            except (OSError, PodStateError, NetworkError, cgroups.CgroupError) as exc:
                log.warning("the state of sandbox %s stays: %s", group, exc)
                continue
        swept.append(group)
    return swept


@contextlib.contextmanager
def _claimed(state_dir: str, wait: bool) -> Iterator[bool]:
    """An exclusive flock on the state directory while its state is removed, so that a
    sweep and the sandbox's own `delete` never remove it at once; yields whether it is
    held (False: the directory is gone, or, without `wait`, another holds it)."""
    try:
        fd = os.open(state_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        yield False
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


def pod_mount_process(pids: list[int]) -> int | None:
    """The first of `pids` (the pod's daemon, its QEMU) alive in a mount namespace other
    than this process's: the pod's, where its mounts are (None: no such process is left,
    and the namespace went with them, or this process is in it). Not the guest's
    namespace holder: a host process whose mount namespace is the pod's."""
    mine = mountns.namespace_of("self")
    for pid in pids:
        ns = mountns.namespace_of(pid)
        if ns is not None and ns != mine and start_time(pid) is not None:
            return pid
    return None


def unmount_in_pod(points: list[str], pod_process: int | None, sandbox: str) -> int:
    """Everything mounted at or below `points`: in the pod's mount namespace through the
    live process `pod_process`, then in this one (where a podvm before the pod's own
    namespace made them); how many mounts."""
    count = 0
    if pod_process is not None:
        count = mountns.in_namespace(f"/proc/{pod_process}/ns/mnt", _unmount_each, points)
        log.info("sandbox %s: %d mounts under %s unmounted in the pod's mount namespace "
                 "(pid %d's)", sandbox, count, ", ".join(points), pod_process)
    here = _unmount_each(points)
    if here or pod_process is None:
        log.info("sandbox %s: %d mounts under %s unmounted in this process's mount namespace"
                 "%s", sandbox, here, ", ".join(points),
                 "" if pod_process is not None else
                 " (no other process of the pod holds one: its namespace, if it had its "
                 "own, went with its mounts)")
    return count + here


def _unmount_each(points: list[str]) -> int:
    return sum(unmount_all(p) for p in points)


def _qemus_of_state_dir(state_dir: str) -> list[int]:
    try:
        state = PodState.load(state_path(state_dir))
    except (FileNotFoundError, PodStateError):
        return qemus_of(state_dir + "/")
    return qemus_of(state.qmp_socket or state_dir + "/")


def cleanup_from_state(state_dir: str) -> None:
    """After a crash: kill the sandbox's QEMU and wait until it is gone, unmount
    everything, then remove the cgroups (nothing of the VM is left to create threads
    in them), from sandbox.json. Without a readable one, QEMU and the mounts under the
    state directory still go; then its PodStateError is raised."""
    try:
        state: PodState | None = PodState.load(state_path(state_dir))
        unreadable = None
    except FileNotFoundError:  # nothing was ever booted
        state, unreadable = None, None
    except PodStateError as exc:
        state, unreadable = None, exc
    # Every QEMU whose command line names the state directory (also one whose pid was
    # never recorded): the pod's, whose QMP socket is in its vm/, and the template its
    # shim was making, in vm-template/ beside it
    qemus = set(qemus_of(state_dir + "/"))
    if state is not None and state.qemu_start_time is not None and \
            start_time(state.qemu_pid) == state.qemu_start_time:  # still the QEMU it was
        qemus.add(state.qemu_pid)
    sandbox = os.path.basename(state_dir)
    for pid in sorted(qemus):
        log.info("killing QEMU %d of sandbox %s", pid, sandbox)
        kill_and_wait(pid)
    for pid in processes_of("virtiofsd", state_dir + "/"):  # ends with QEMU, unless
        log.info("killing virtiofsd %d of sandbox %s", pid, sandbox)  # none ever came
        kill_and_wait(pid)
    # No QEMU of the pod runs any more: the ids they ran as are free (the VM's, and a
    # template's its shim was making)
    for number in jailids.release_under(state_dir):
        log.info("dropped sandbox %s's claim of jail id %d", sandbox, number)
    # A QEMU that would not die still holds the pod's mount namespace (the daemon, when
    # it runs this, is in that namespace itself).
    pod_process = pod_mount_process(sorted(qemus))
    unmount_in_pod([state_dir, *(state.rootfs.values() if state is not None else ())],
                   pod_process, sandbox)
    if unreadable is not None:
        raise unreadable
    if state is None:
        return
    failed = None
    if state.netns:
        # Here, not at the top: a pod with a network only (asyncio, for `delete`)
        from ..network import remote

        try:
            remote.detach_now(state.netns, state.taps)
        except NetworkError as exc:  # the cgroups still go
            failed = exc
    destroy_cgroups(state.cgroup)
    if state.template_cgroup is not None:
        destroy_cgroups(state.template_cgroup)
        remove_parent_if_empty(state.template_cgroup)
    if failed is not None:
        raise failed


def qemus_of(marker: str) -> list[int]:
    """The QEMU processes with `marker` (the sandbox's QMP socket) in an argument of their
    command line: also a QEMU started just before a crash, whose pid never reached
    sandbox.json."""
    return processes_of("qemu", marker)


def processes_of(program: str, marker: str) -> list[int]:
    """The processes whose program's name has `program` in it and one of whose arguments
    has `marker` (a path of the sandbox's)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmd = proc.info["cmdline"] or []
        if cmd and program in os.path.basename(cmd[0]) and any(marker in a for a in cmd):
            found.append(proc.pid)
    return found


def destroy_cgroups(state: CgroupState) -> None:
    """The sandbox cgroup (and the shim's overhead cgroup), without probing the host."""
    manager = cgroups.manager_from_state(dict(state.manager))
    manager.destroy(state.layout)
    if state.overhead is not None:
        manager.destroy(state.overhead)


def remove_parent_if_empty(state: CgroupState) -> None:
    """The cgroup above `state`'s sandbox cgroup (template_cgroup, where templates are
    made), once nothing else is in it: between makes, nothing of the templates stays in
    the node's cgroups but the page cache's (shim/vm/template/cache.py)."""
    manager = cgroups.manager_from_state(dict(state.manager))
    hierarchies = manager.hierarchies if isinstance(manager, cgroups.CgroupV1Manager) \
        else (manager.hierarchy,)
    for h in hierarchies:
        try:
            os.rmdir(h.directory(state.layout.pod_cgroup))
        except OSError:  # another maker's, or gone
            pass


def remove_tree(path: str) -> None:
    """rmtree that never reaches through a mount into what it shares."""
    left = mounts_under(path)
    if left:
        raise OSError(f"refusing to remove {path}: still mounted: {', '.join(left)}")
    shutil.rmtree(path, ignore_errors=True)
