"""runc, as the agent drives it: one container per pod container, bundles under /run."""
from __future__ import annotations

import json
import os

from podvm_core.ttrpc import Code, TtrpcError

from .reaper import run

RUNC = "/usr/sbin/runc"
ROOT = "/run/runc"
BUNDLES = "/run/podvm/bundles"


def bundle_dir(container_id: str) -> str:
    return os.path.join(BUNDLES, container_id)


def log_path(container_id: str) -> str:
    return os.path.join(BUNDLES, f"{container_id}.runc.log")


async def runc(container_id: str, *args: str, stdin: int | None = None,
               stdout: int | None = None, stderr: int | None = None) -> bytes:
    """Run `runc <args>`; its errors become FAILED_PRECONDITION (INTERNAL when unclear)
    with runc's own words."""
    log = log_path(container_id)
    argv = [RUNC, "--root", ROOT, "--log", log, "--log-format", "json", *args]
    status, out, err = await run(argv, stdin=stdin, stdout=stdout, stderr=stderr)
    if status != 0:
        message = _last_error(log) or err.decode(errors="replace").strip() or f"exit {status}"
        code = Code.NOT_FOUND if "does not exist" in message else Code.FAILED_PRECONDITION
        raise TtrpcError(code, f"runc {args[0]} {container_id}: {message}")
    return out


def not_running(message: str) -> bool:
    """runc's words for a container whose init has exited: a signal came too late."""
    return any(words in message for words in ("container not running",
                                              "no such process", "process already finished"))


def _last_error(log: str) -> str:
    try:
        with open(log) as f:
            lines = f.read().splitlines()
    except OSError:
        return ""
    for line in reversed(lines):
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("level") in ("error", "fatal"):
            return entry.get("msg", "")
    return ""
