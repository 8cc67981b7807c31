"""The one error of pod networking: which namespace, which interface, which step."""
from __future__ import annotations


class NetworkError(Exception):
    """A pod's network could not be read, attached or detached. The message says
    "<netns>: <interface>: <step>: <cause>" (no interface for namespace-wide steps)."""

    def __init__(self, netns: str, step: str, cause: str, interface: str | None = None):
        where = f"{netns}: {interface}" if interface else netns
        super().__init__(f"network namespace {where}: {step}: {cause}")
        self.netns = netns
        self.interface = interface
        self.step = step
        self.cause = cause


class NamespaceGone(NetworkError):
    """The namespace's path names no network namespace any more (containerd removed it,
    or the process that held it exited)."""
