"""The harness tests and benchmarks share: CRI pod and container configurations for a test
containerd, and the pod VMs, processes and state such a containerd's pods leave, as seen
from the host."""
from __future__ import annotations

import os
import pathlib

from shim.host import paths
from shim.host.cleanup import processes_of

from .containerd import CRI_NAMESPACE, Containerd, mounts_under, shims_of
from .netpods import pod_network_config


def pod_config(ctd: Containerd, configs: pathlib.Path, name: str, **extra) -> dict:
    """A pod on the POD network (the test containerd's CNI bridge): podvm refuses the
    host's network, which a VM cannot have."""
    return pod_network_config(ctd, configs, name, **extra)


def container_config(name: str, script: str) -> dict:
    from .image import IMAGE_NAME

    return {"metadata": {"name": name}, "image": {"image": IMAGE_NAME},
            "command": ["sh", "-c", script], "log_path": f"{name}.log"}


def qemus(cgroup_parent: str = "") -> list[int]:
    """Pod QEMUs running now; with `cgroup_parent`, only those in a cgroup below it (the
    pods of one test containerd: other VMs on the machine are not this test's)."""
    found = []
    for pid in os.listdir("/proc"):
        try:
            cmdline = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
            groups = pathlib.Path(f"/proc/{pid}/cgroup").read_text() if cgroup_parent else ""
        except OSError:
            continue
        if b"qemu-system" in cmdline and b"podvm-" in cmdline and \
                f":{cgroup_parent}/" in (groups if cgroup_parent else ":/"):
            found.append(int(pid))
    return found


def pod_qemus(pod_id: str) -> list[int]:
    return [pid for pid in qemus() if pod_id.encode() in _cmdline(pid)]


def pod_file_servers(pod_id: str) -> list[int]:
    return processes_of("virtiofsd", pod_id)


def _cmdline(pid: int) -> bytes:
    try:
        return pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def pod_processes(ctd: Containerd, pod_id: str) -> list[int]:
    """The pod's shim daemon and QEMU."""
    return [pid for pid, cmd in shims_of(ctd.address) if pod_id in cmd] + pod_qemus(pod_id)


def podvm_leftovers(ctd: Containerd, pod_id: str) -> list[str]:
    found = [f"shim {cmd}" for _, cmd in shims_of(ctd.address) if pod_id in cmd]
    found += [f"qemu {pid}" for pid in pod_qemus(pod_id)]
    found += [f"virtiofsd {pid}" for pid in pod_file_servers(pod_id)]
    # the host's namespace (a podvm before the pod's own namespace mounted there), and
    # the pod's, seen through its processes
    for pid in ("self", *pod_processes(ctd, pod_id)):
        where = "" if pid == "self" else f" in pid {pid}'s mount namespace"
        found += [f"mount {m}{where}" for m in mounts_under(ctd.workdir, pid) if pod_id in m]
        found += [f"mount {m}{where}" for m in
                  mounts_under(pathlib.Path(paths.STATE_ROOT), pid) if pod_id in m]
    state = paths.state_dir(CRI_NAMESPACE, pod_id)
    if os.path.exists(state):
        found.append(f"state {state}")
    sock = paths.socket_path(paths.socket_address(ctd.address, CRI_NAMESPACE, pod_id))
    if os.path.exists(sock):
        found.append(f"socket {sock}")
    return found
