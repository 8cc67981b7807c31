"""The harness tests and benchmarks share: containerd namespaces of this run alone, and
their state directories removed when the run ends."""
from __future__ import annotations

import os

from shim.host.paths import STATE_ROOT

_run_namespaces: set[str] = set()


def run_namespace(prefix: str) -> str:
    """A containerd namespace for this run alone (another run on the machine has its
    own /run/podvm/<namespace>); its directory there is removed when the run ends."""
    namespace = f"{prefix}-{os.getpid()}"
    _run_namespaces.add(namespace)
    return namespace


def remove_run_namespaces() -> None:
    for namespace in _run_namespaces:
        try:
            os.rmdir(os.path.join(STATE_ROOT, namespace))  # empty, or a test left state
        except (FileNotFoundError, OSError):
            pass
