"""The guest's own part of the spec: container cgroups under /podvm, and namespaces that
the shim marked as the pod's joined through the sandbox container's init. The cpuset in
the spec is already the guest's (vCPUs), as the shim's guestspec wrote it."""
from __future__ import annotations

import copy
from podvm_core.protocol import SANDBOX_NS

CGROUP_PARENT = "/podvm"


def guest_spec(spec: dict, container_id: str, sandbox_pid: int) -> dict:
    spec = copy.deepcopy(spec)
    linux = spec.setdefault("linux", {})
    linux["cgroupsPath"] = f"{CGROUP_PARENT}/{container_id}"
    # linux.resources.cpu.cpus, when present, names guest vCPUs: the shim put it there.
    namespaces = []
    for ns in linux.get("namespaces") or []:
        if ns.get("type") == "network":
            continue  # the guest's network is the pod's until pod networking exists
        path = ns.get("path")
        if path == SANDBOX_NS:
            if not sandbox_pid:
                ns = {"type": ns["type"]}
            else:
                ns = {"type": ns["type"], "path": f"/proc/{sandbox_pid}/ns/{_proc_name(ns)}"}
        elif path:
            ns = {"type": ns["type"]}  # a host path means nothing here
        namespaces.append(ns)
    linux["namespaces"] = namespaces
    process = spec.setdefault("process", {})
    process.pop("apparmorProfile", None)
    process.pop("selinuxLabel", None)
    spec.pop("hooks", None)
    return spec


def _proc_name(ns: dict) -> str:
    return {"network": "net", "mount": "mnt"}.get(ns["type"], ns["type"])
