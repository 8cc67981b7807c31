"""The host namespaces a pod may ask to share (hostNetwork, hostPID, hostIPC), which a
VM pod cannot honour: both APIs refuse them with the same answer, before anything is
made."""
from __future__ import annotations

from podvm_core.ttrpc import Code, TtrpcError

HOST_NAMESPACES = {"network": "hostNetwork", "pid": "hostPID", "ipc": "hostIPC"}


def host_namespaces_refusal(shared: list[str]) -> TtrpcError:
    """The answer for a pod that would share the host's `shared` namespaces (OCI names):
    a VM has its own kernel, so it cannot honour them."""
    fields = ", ".join(f"{HOST_NAMESPACES[ns]}: true" for ns in shared)
    return TtrpcError(Code.INVALID_ARGUMENT, (
        f"podvm runs the pod in a VM, with its own kernel: a pod that shares the host's "
        f"{' and '.join(shared)} namespace{'s' if len(shared) > 1 else ''} ({fields}; CRI "
        f"namespace option NODE) cannot be; run it with runc"))
