"""A node's reboot played on a test containerd and its podvm pods: power lost, then what a
boot would not bring back removed, and nothing else.

Power loss takes every process at once: the containerd, its shims and everything they
started (QEMUs, virtiofsds, a template's QEMU), frozen first (SIGSTOP) so that none of them
sees another die and cleans up after it, then SIGKILLed. What the boot then does not bring
back, each only for the pods named (the test's own; other tests' pods share this machine):

- /run, a tmpfs: the test containerd's state directory (its `state`, the node's
  /run/containerd) and its sockets, each pod's podvm state directory
  (/run/podvm/<namespace>/<pod>: shim/host/paths.py), its shim's socket
  (/run/containerd/s/<hash>), its QEMUs' jail-id claims (/run/podvm/jail-ids:
  shim/host/jailids.py);
- the kernel's state: the mounts in the host's namespace under those directories (the
  CRI's /dev/shm of each sandbox); each pod's network namespace, with its taps, routes,
  tc redirects and the pod's iptables rules, all in that namespace (its only holder left
  is the CRI's bind mount in /run/netns: unmounted and removed, the namespace goes); the
  cgroups below the containerd's cgroup parent and below the templates' cgroup (pod,
  sandbox, vCPU, overhead and template cgroups: cgroupfs is empty after a boot). The
  pods' own mount namespaces went with their last process.

What stays is what a disk keeps: the containerd's root (its metadata naming the old
sandboxes, containers and tasks), podvm's template store and scratch_path, /etc; and the
CNI bridge (testbed/bridgenet.py, the node's network: made again at boot on a node) with
its IPAM records, which are in /var/lib on a node."""
from __future__ import annotations

import os
import pathlib
import shutil
import signal
import subprocess
import time

import psutil

from podvm_core.treegc import alive
from shim.host import jailids, paths

from .cgroupdirs import remove_cgroup
from .containerd import CRI_NAMESPACE, Containerd, mounts_under, shims_of
from .cri import Crictl


def network_namespace(crictl: Crictl, pod_id: str) -> str:
    """The path of the pod's network namespace as the CRI made it (/run/netns/cni-...)."""
    namespaces = crictl.inspectp(pod_id)["info"]["runtimeSpec"]["linux"]["namespaces"]
    return next(n["path"] for n in namespaces if n["type"] == "network")


def processes(ctd: Containerd, pod_ids: list[str]) -> list[int]:
    """Every process a power loss takes from the test's node: its containerd, its shims
    and their descendants, and any QEMU or virtiofsd naming one of the pods."""
    roots = [ctd.process.pid] if ctd.process and ctd.process.poll() is None else []
    roots += [pid for pid, _ in shims_of(ctd.address)]
    found = set()
    for pid in roots:
        try:
            proc = psutil.Process(pid)
            found |= {pid, *(c.pid for c in proc.children(recursive=True))}
        except psutil.NoSuchProcess:
            continue
    for proc in psutil.process_iter(["cmdline"]):
        cmd = proc.info["cmdline"] or []
        if cmd and any(p in os.path.basename(cmd[0]) for p in ("qemu", "virtiofsd")) and \
                any(pod in arg for pod in pod_ids for arg in cmd):
            found.add(proc.pid)
    return sorted(found)


def power_loss(ctd: Containerd, pod_ids: list[str]) -> list[int]:
    """Every process of the node (processes()) stopped at once, then killed; returns
    once all are gone. The pids killed."""
    pids = processes(ctd, pod_ids)
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
    if ctd.process is not None:
        ctd.process.wait(timeout=30)  # our child: reaped here
    deadline = time.monotonic() + 30
    while left := [p for p in pids if _threads_left(p)]:
        if time.monotonic() > deadline:
            raise AssertionError(f"still running after SIGKILL: {left}")
        time.sleep(0.1)
    return pids


def _threads_left(pid: int) -> bool:
    """Whether a thread of process `pid` has yet to exit. A killed process's leader is a
    zombie as soon as it exits, while its other threads may still be exiting (a QEMU's
    vCPU threads, each in the pod's vCPU cgroup until it has: a cgroup's removal
    before then fails with EBUSY)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return False
    return any(alive(int(tid)) for tid in tids)  # /proc/TID is each thread's too


def boot(ctd: Containerd, pod_ids: list[str], netns_paths: list[str],
         template_cgroup: str) -> list[str]:
    """What a boot does not bring back, for the pods `pod_ids` (module docstring),
    removed; what was removed, one line each. Call after power_loss()."""
    removed = []
    run_dirs = [pathlib.Path(ctd.state)] + [
        pathlib.Path(paths.state_dir(CRI_NAMESPACE, pod)) for pod in pod_ids]
    for directory in run_dirs:
        for mount in reversed(mounts_under(directory)):
            _umount(mount)
            removed.append(f"mount {mount}")
    for path in netns_paths:
        if os.path.exists(path):
            _umount(path)
            os.unlink(path)
            removed.append(f"network namespace {path}")
    for directory in run_dirs:
        if directory.exists():
            shutil.rmtree(directory)
            removed.append(f"directory {directory}")
    sockets = [ctd.address, ctd.ttrpc_address] + [
        paths.socket_path(paths.socket_address(ctd.address, CRI_NAMESPACE, pod))
        for pod in pod_ids]
    for sock in sockets:
        if os.path.exists(sock):
            os.unlink(sock)
            removed.append(f"socket {sock}")
    removed += _remove_claims(pod_ids)
    for parent in (ctd.cgroup_parent, template_cgroup):
        removed += _remove_cgroups(parent)
    return removed


def _umount(path: str) -> None:
    subprocess.run(["umount", path], check=True, capture_output=True, timeout=30)


def claims_of(pod_ids: list[str]) -> list[str]:
    """The jail-id claims (their paths) whose owner is a VM of one of the pods."""
    try:
        names = os.listdir(jailids.CLAIMS)
    except FileNotFoundError:
        return []
    found = []
    for name in names:
        path = os.path.join(jailids.CLAIMS, name)
        try:
            owner = pathlib.Path(path).read_text()
        except OSError:
            continue
        if any(pod in owner for pod in pod_ids):
            found.append(path)
    return found


def _remove_claims(pod_ids: list[str]) -> list[str]:
    removed = []
    for path in claims_of(pod_ids):
        os.unlink(path)
        removed.append(f"jail-id claim {path}")
    return removed


def _remove_cgroups(parent: str) -> list[str]:
    """`parent` and every cgroup below it, in each hierarchy, deepest first."""
    return [f"cgroup {d}" for d in remove_cgroup(parent)]
