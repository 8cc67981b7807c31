"""The OCI spec as the guest must see it: the rootfs and every host file the container
mounts come through the pod's shared directory; host-only parts are dropped.

Pure but for one look at the host's mount table (the `submounts` argument): returns the
rewritten spec and the binds the shim must make on the host.

Read-only binds: the guest sees a bind's whole host tree, submounts included, as one 9p
mount, or over virtio-fs as submounts of the share that carry the host's flags, so a
read-only bind there is read-only all the way down, which is what `rro`
(RecursiveReadOnly) asks; the guest's runc does not know `rro` and gets `ro`, and the
host makes the bind read-only all the way down too (a container that broke out to root
in the guest could otherwise write the submounts through the share). A
plain `ro` bind is read-only at its top only, as runc makes it: each host mount below
its source comes again as a bind of its own, on top, with its own flags (rw unless it
is read-only itself).

A disk emptyDir (shim/host/emptydir.py) is the guest's own when the pod has a scratch
disk: its binds name a directory under GUEST_VOLUMES, which the agent makes there."""
from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from typing import Callable

from podvm_core.protocol import GUEST_VOLUMES, SANDBOX_NS

from ..host import emptydir
from ..host import mounts as host_mounts

GUEST_SHARED = "/run/podvm/shared"
"""A namespace path the agent resolves to the guest sandbox container's."""
GUEST_ROOTS = "/run/podvm/rootfs"
"""Where the agent makes a container's root that has its writable layer in the guest."""
_HOST_KERNEL_PATHS = ("/dev", "/proc", "/sys")
_SHM_TMPFS = {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
              "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]}


@dataclass(frozen=True)
class HostBind:
    source: str
    """Host path (file or directory)."""
    target: str
    """Path relative to the shared directory: `<container>/mounts/<name>`."""
    readonly: bool
    recursive: bool = False
    """Read-only all the way down (`rro`): on the host too, so that guest root reaching
    the share cannot write the submounts either."""

    @property
    def name(self) -> str:
        return self.target.rsplit("/", 1)[1]


@dataclass(frozen=True)
class GuestSpec:
    spec: dict
    binds: tuple[HostBind, ...]
    dropped: tuple[str, ...]
    """What was left out, for the log."""
    rootfs_lower: str = ""
    """The share's directory the agent lays the container's writable layer over (its
    root, root.path, is then the guest's own overlay); "" when the share is the root."""
    local_dirs: tuple[emptydir.LocalDir, ...] = ()
    """The guest's directories the container's emptyDir binds need, each volume's first."""


def rootfs_path(container_id: str) -> str:
    """The container's rootfs relative to the shared directory."""
    return f"{container_id}/rootfs"


def rewrite(spec: dict, container_id: str, guest_cpus: list[int] | None = None,
            submounts: Callable[[str], list[host_mounts.Submount]] = host_mounts.submounts,
            writable_in_guest: bool = False,
            local_dirs: Callable[[str], tuple[emptydir.LocalDir, ...] | None] | None = None
            ) -> GuestSpec:
    """`guest_cpus`: the vCPUs the container's host cpuset maps to (pinned vCPUs), which
    become its cpuset in the guest; none: the host cpuset is dropped. `submounts`: what
    is mounted below a host directory (the host's mount table). `writable_in_guest`: the
    container's writable layer is on the pod's scratch disk, over its image in the
    share (GuestSpec.rootfs_lower). `local_dirs`: which binds are volumes the guest keeps
    (shim/host/emptydir.py local_dirs), none when it keeps none."""
    spec = copy.deepcopy(spec)
    root = spec.get("root") or {}
    shared_root = f"{GUEST_SHARED}/{rootfs_path(container_id)}"
    spec["root"] = {"path": f"{GUEST_ROOTS}/{container_id}" if writable_in_guest
                    else shared_root, "readonly": bool(root.get("readonly", False))}
    binds: list[HostBind] = []
    dropped: list[str] = []
    local: list[emptydir.LocalDir] = []
    mounts = []
    for index, m in enumerate(spec.get("mounts") or []):
        options = m.get("options") or []
        if m.get("type") != "bind" and "bind" not in options and "rbind" not in options:
            mounts.append(m)  # proc, tmpfs, sysfs, devpts...: made fresh in the guest
            continue
        destination, source = m.get("destination", ""), m.get("source", "")
        if destination == "/dev/shm":
            mounts.append(dict(_SHM_TMPFS))
            dropped.append(f"bind {source} on /dev/shm (a tmpfs in the guest instead)")
        elif any(source == p or source.startswith(p + "/") for p in _HOST_KERNEL_PATHS):
            dropped.append(f"bind of host kernel path {source} on {destination}")
        elif local_dirs is not None and (dirs := local_dirs(source)):
            local.extend(d for d in dirs if d not in local)
            mounts.append(_guest_bind(m, f"{GUEST_VOLUMES}/{dirs[-1].path}"))
        else:
            name = f"{index}-{os.path.basename(destination.rstrip('/')) or 'root'}"
            target = f"{container_id}/mounts/{name}"
            recursive = "rro" in options
            binds.append(HostBind(source, target, recursive or "ro" in options, recursive))
            mounts.append(_guest_bind(m, f"{GUEST_SHARED}/{target}"))
            if "ro" in options and not recursive:
                mounts.extend(_writable_below(destination, target, submounts(source)))
    spec["mounts"] = mounts
    if spec.pop("hooks", None):
        dropped.append("OCI hooks (they would run on the host's paths)")
    _rewrite_linux(spec.setdefault("linux", {}), guest_cpus, dropped)
    return GuestSpec(spec, tuple(binds), tuple(dropped),
                     shared_root if writable_in_guest else "", tuple(local))


def _rewrite_linux(linux: dict, guest_cpus: list[int] | None, dropped: list[str]) -> None:
    """The spec's `linux` for the guest: no host cgroup path or cpuset (the vCPUs
    `guest_cpus` instead), the pod's namespaces the sandbox container's in the guest."""
    linux.pop("cgroupsPath", None)
    cpu = (linux.get("resources") or {}).get("cpu") or {}
    for key in ("cpus", "mems"):
        if cpu.pop(key, None):
            dropped.append(f"host cpuset {key} (enforced on the host, not in the guest)")
    if guest_cpus:
        linux.setdefault("resources", {}).setdefault("cpu", {})["cpus"] = cpu_list(guest_cpus)
    namespaces = []
    for ns in linux.get("namespaces") or []:
        if ns.get("type") == "network":
            continue  # the pod's interfaces are the VM's: containers use the guest's network
        if ns.get("path"):  # the pod's namespace, held by the sandbox container's init
            ns = {"type": ns.get("type"), "path": SANDBOX_NS}
        namespaces.append(ns)
    linux["namespaces"] = namespaces


def _guest_bind(m: dict, source: str) -> dict:
    """A bind `m` from `source` in the guest; `rro` as `ro`, which the guest's runc knows."""
    guest = dict(m, source=source)
    options = m.get("options") or []
    if "rro" in options:
        guest["options"] = ["ro", *(o for o in options if o not in ("rro", "ro", "rw"))]
    return guest


def _writable_below(destination: str, target: str,
                    below: list[host_mounts.Submount]) -> list[dict]:
    """The binds that keep a read-only bind's submounts as they are on the host."""
    return [{"destination": f"{destination.rstrip('/')}/{s.path}", "type": "bind",
             "source": f"{GUEST_SHARED}/{target}/{s.path}", "options": ["rbind", *s.options]}
            for s in below]


def resources(resources: dict, guest_cpus: list[int] | None = None) -> dict:
    """LinuxResources for the guest: the host cpuset stays on the host; the vCPUs it maps
    to (`guest_cpus`), if any, are the container's cpuset in the guest."""
    resources = copy.deepcopy(resources)
    cpu = resources.get("cpu") or {}
    cpu.pop("cpus", None)
    cpu.pop("mems", None)
    if guest_cpus:
        resources.setdefault("cpu", {})["cpus"] = cpu_list(guest_cpus)
    return resources


def cpu_list(cpus: list[int]) -> str:
    return ",".join(str(c) for c in sorted(cpus))
