"""What a pod may ask to share with the host and a VM pod cannot honour, refused with
InvalidArgument at the first call that asks, before anything is made: the host's
namespaces (hostNetwork, hostPID, hostIPC; both APIs give the same answer) and mount
propagation from the host (a container's mountPropagation HostToContainer or
Bidirectional: the host's later mounts cannot reach into the guest's kernel)."""
from __future__ import annotations

from collections.abc import Sequence

from .errors import Refused

HOST_NAMESPACES = {"network": "hostNetwork", "pid": "hostPID", "ipc": "hostIPC"}


def spec_namespaces(spec: dict) -> dict[str, str]:
    """An OCI spec's namespaces: type -> path ("" for a new one); a type not listed is
    the host's."""
    return {ns.get("type"): ns.get("path") or "" for ns in
            (spec.get("linux") or {}).get("namespaces") or []}


def refuse_host_namespaces(shared: Sequence[str]) -> None:
    """Refuse a pod that would share the host's `shared` namespaces (OCI names; none:
    nothing to refuse): a VM has its own kernel, so it cannot honour them."""
    if not shared:
        return
    fields = ", ".join(f"{HOST_NAMESPACES[ns]}: true" for ns in shared)
    raise Refused((
        f"podvm runs the pod in a VM, with its own kernel: a pod that shares the host's "
        f"{' and '.join(shared)} namespace{'s' if len(shared) > 1 else ''} ({fields}; CRI "
        f"namespace option NODE) cannot be; run it with runc"))


# OCI mount options (and linux.rootfsPropagation values) that containerd's CRI writes for
# mountPropagation: HostToContainer gives rslave, Bidirectional rshared.
_FROM_HOST = {"rslave": "HostToContainer", "slave": "HostToContainer",
              "rshared": "Bidirectional", "shared": "Bidirectional"}


def refuse_host_propagation(container_id: str, spec: dict) -> None:
    """Refuse a container whose mounts would receive the host's later mounts (or send
    theirs back): the guest has its own kernel and mount table."""
    asked = [(m.get("destination", "?"), opt) for m in spec.get("mounts") or []
             for opt in m.get("options") or [] if opt in _FROM_HOST]
    rootfs = (spec.get("linux") or {}).get("rootfsPropagation", "")
    if not asked and rootfs in _FROM_HOST:
        asked = [("/ (rootfsPropagation)", rootfs)]
    if asked:
        where = ", ".join(f"{dest} ({opt}: mountPropagation {_FROM_HOST[opt]})"
                          for dest, opt in asked)
        raise Refused((
            f"container {container_id}: podvm runs the pod in a VM, with its own kernel and "
            f"mount table: mount propagation from the host cannot reach it ({where}); use "
            f"mountPropagation None, or run the pod with runc"))
