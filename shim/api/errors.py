"""One table from podvm's typed errors to the ttrpc codes containerd sees, as containerd's
errgrpc does for Go errors: every answer a handler gives for a failure comes from here.

Classes are named by module so that this table loads nothing: an error whose module was
never imported cannot have been raised (the idle daemon stays small)."""
from __future__ import annotations

import sys

from podvm_core.ttrpc import Code, TtrpcError

# Most specific first: the first class an error is an instance of gives its code.
TABLE: tuple[tuple[str, str, Code], ...] = (
    # The configuration names a VMM, kernel or initrd that is not there: fix the node.
    ("shim.vm.hypervisor", "MissingFile", Code.FAILED_PRECONDITION),
    # The VM runs but cannot grow (no free vCPU slot, above maxmem): change the request.
    ("shim.vm.hypervisor", "CannotGrow", Code.FAILED_PRECONDITION),
    # The VM died, never came up, or cannot be reached: nothing the request can change.
    ("shim.vm.hypervisor", "HypervisorError", Code.UNAVAILABLE),
    # What the pod refuses (shim/pod/errors.py): change the request.
    ("shim.pod.errors", "Refused", Code.INVALID_ARGUMENT),
    # The pod's VM is not running (yet, or any more): nothing to act on.
    ("shim.pod.errors", "NotRunning", Code.FAILED_PRECONDITION),
    # The host cannot give a Sandbox-API pod its /etc files: fix the node.
    ("shim.pod.errors", "PodFilesError", Code.FAILED_PRECONDITION),
    # Growth a static-mode VM cannot take (what fits was applied): change the request.
    ("shim.pod.errors", "StaticRefusal", Code.FAILED_PRECONDITION),
    ("shim.resources.model", "NoFit", Code.RESOURCE_EXHAUSTED),
    ("shim.resources.update", "StaticSizeExceeded", Code.FAILED_PRECONDITION),
    ("shim.resources.model", "PlanError", Code.INVALID_ARGUMENT),
    ("shim.cpus.allocator", "AllocatorError", Code.RESOURCE_EXHAUSTED),
    ("cgroups.errors", "InvalidLimits", Code.INVALID_ARGUMENT),
    ("podvm_core.cpulist", "CpuListError", Code.INVALID_ARGUMENT),
    ("cgroups.errors", "CgroupPathError", Code.INVALID_ARGUMENT),
    ("cgroups.errors", "CgroupError", Code.FAILED_PRECONDITION),
    ("shim.config", "ConfigError", Code.INVALID_ARGUMENT),
)


AS_WORDED: tuple[tuple[str, str], ...] = (
    ("shim.pod.errors", "Refused"),
    ("shim.pod.errors", "NotRunning"),
    ("shim.pod.errors", "PodFilesError"),
)
"""Errors whose message is the answer as containerd reads it (no "podvm: " before it)."""

CAUSED: tuple[tuple[str, str], ...] = (
    ("shim.pod.errors", "StepFailed"),
)
"""Errors that say which step failed (`step`) with which typed error (`cause`): answered
with the cause's code, "podvm: <step>: <cause>"."""


def _is(exc: BaseException, rows: tuple[tuple[str, str], ...]) -> bool:
    for module, name in rows:
        cls = getattr(sys.modules.get(module), name, None)
        if cls is not None and isinstance(exc, cls):
            return True
    return False


def code_of(exc: BaseException) -> Code:
    """The ttrpc code `exc` answers with; UNKNOWN for what no row names (a bug)."""
    if isinstance(exc, TtrpcError):
        return exc.code
    if _is(exc, CAUSED):
        return code_of(exc.cause)  # type: ignore[attr-defined]
    for module, name, code in TABLE:
        cls = getattr(sys.modules.get(module), name, None)
        if cls is not None and isinstance(exc, cls):
            return code
    return Code.UNKNOWN


def to_ttrpc(exc: BaseException, context: str = "") -> TtrpcError:
    """`exc` as the answer containerd gets: its code, and "podvm: <context>: <message>"."""
    if isinstance(exc, TtrpcError):
        return exc
    if _is(exc, CAUSED):
        step = exc.step  # type: ignore[attr-defined]
        return to_ttrpc(exc.cause,  # type: ignore[attr-defined]
                        f"{context}: {step}" if context and step else context or step)
    if _is(exc, AS_WORDED):
        return TtrpcError(code_of(exc), str(exc))
    prefix = f"podvm: {context}: " if context else "podvm: "
    return TtrpcError(code_of(exc), f"{prefix}{exc}")
