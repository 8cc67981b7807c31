"""shim.json: which daemon serves a pod (pid, address, bundle), written by `start` and read
by `delete`, the daemon's exit and `podvmctl status`. Standard library only: `start` is on
containerd's critical path."""
from __future__ import annotations

import json
import os

from . import paths

SHIM_STATE = "shim.json"


def write_atomic(path: str, data: bytes) -> None:
    """`path` holds either its old content or `data`, never a part of it."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def write(namespace: str, group: str, state: dict) -> None:
    directory = paths.state_dir(namespace, group)
    os.makedirs(directory, mode=0o700, exist_ok=True)
    write_atomic(os.path.join(directory, SHIM_STATE), json.dumps(state).encode())


def read(namespace: str, group: str) -> dict | None:
    try:
        with open(os.path.join(paths.state_dir(namespace, group), SHIM_STATE), "rb") as f:
            return json.load(f)
    except (FileNotFoundError, ValueError):
        return None
