"""What the pod refuses or cannot do, as typed errors: shim/api/errors.py's table gives
each its ttrpc code at the edge, so the pod's code never speaks ttrpc. The messages of
Refused, NotRunning and PodFilesError are the answers containerd reads, word for word;
the others are answered as every typed error is ("podvm: ..."), as before."""
from __future__ import annotations


class PodError(Exception):
    """A failure of the pod (the classes below)."""


class Refused(PodError):
    """A request the pod cannot honour as asked: the host's namespaces, a VM-wide sysctl,
    mount propagation from the host, resources or files it cannot take. INVALID_ARGUMENT."""


class NotRunning(PodError):
    """The pod's VM is not running (not booted yet, or stopped). FAILED_PRECONDITION."""

    def __init__(self, message: str = "the pod's VM is not running") -> None:
        super().__init__(message)


class PodFilesError(PodError):
    """A Sandbox-API pod's /etc files cannot be read or written on the host.
    FAILED_PRECONDITION."""


class StaticRefusal(PodError):
    """Growth a static-mode VM cannot take: refused, after what fits was applied.
    FAILED_PRECONDITION."""


class StepFailed(PodError):
    """A step of the pod failed with `cause`, a typed error of a room below (a cgroup or
    hypervisor error): answered with the cause's code, the step saying what was done."""

    def __init__(self, step: str, cause: BaseException) -> None:
        super().__init__(f"{step}: {cause}" if step else str(cause))
        self.step = step
        self.cause = cause


class VMGone(StepFailed):
    """The pod's VM died under it: every later call that needs the guest gets how."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__("", cause)
