"""shim.json: which daemon serves a pod (pid, address, bundle), written by `start` and read
by `delete`, the daemon's exit and `podvmctl status`. Standard library only: `start` is on
containerd's critical path."""
from __future__ import annotations

import os

from podvm_core import lightjson
from podvm_core.atomic import write_json

from . import paths

SHIM_STATE = "shim.json"


def write(namespace: str, group: str, state: dict) -> None:
    directory = paths.state_dir(namespace, group)
    os.makedirs(directory, mode=0o700, exist_ok=True)
    write_json(os.path.join(directory, SHIM_STATE), state)


def read(namespace: str, group: str) -> dict | None:
    try:
        with open(os.path.join(paths.state_dir(namespace, group), SHIM_STATE), "rb") as f:
            return lightjson.loads(f.read())
    except (FileNotFoundError, ValueError):
        return None
