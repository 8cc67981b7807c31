"""Where a shim's things live: its socket, its state, its pod grouping.

Kept free of heavy imports: `start` runs on containerd's critical path.
"""
from __future__ import annotations

import os

from podvm_core import lightjson

# CPython's own SHA-256 where it has one: hashlib loads OpenSSL (about 3 ms, and 4 MB of
# RSS that the daemon `start` forks would keep for its whole life).
try:
    from _sha2 import sha256  # Python 3.12 and later
except ImportError:
    try:
        from _sha256 import sha256  # Python 3.11
    except ImportError:
        from hashlib import sha256  # a Python built without them: OpenSSL's

SOCKET_DIR = "/run/containerd/s"
STATE_ROOT = "/run/podvm"
POD_STATE_FILE = "sandbox.json"
"""In a pod's state directory: what its daemon made on the host (shim/host/podstate.py),
which `delete` also reads without the model (shim/host/leftovers.py)."""
SANDBOX_ID_ANNOTATION = "io.kubernetes.cri.sandbox-id"
RUNTIME_OPTIONS_FILE = "runtime-options.pb"
"""In the bundle: the runtime options `start` got on its stdin, as containerd marshalled
them, for CreateSandbox (shim/contract/manager.py writes it, shim/api/options.py reads it)."""


def read_spec(bundle: str) -> dict | None:
    """The bundle's OCI spec, or None when there is none (containerd 2.x sandbox bundles)."""
    try:
        with open(os.path.join(bundle, "config.json"), "rb") as f:
            return lightjson.loads(f.read())
    except FileNotFoundError:
        return None


def group_id(spec: dict | None, container_id: str) -> str:
    """Containers of one pod share a shim: the pod's sandbox id, else the container's own."""
    annotations = (spec or {}).get("annotations") or {}
    return annotations.get(SANDBOX_ID_ANNOTATION) or container_id


def socket_address(grpc_address: str, namespace: str, group: str) -> str:
    digest = sha256(f"{grpc_address}/{namespace}/{group}".encode()).hexdigest()
    return f"unix://{SOCKET_DIR}/{digest}"


def socket_path(address: str) -> str:
    return address.removeprefix("unix://")


def state_dir(namespace: str, group: str) -> str:
    return os.path.join(STATE_ROOT, namespace, group)
