"""What a Create brings besides its request: the bundle's OCI spec (the podvm
configuration its runtime options name is shim/api/options.py's)."""
from __future__ import annotations

import os

from podvm_core.ttrpc import Code, TtrpcError

from ...host import paths


def read_bundle(bundle: str) -> dict:
    if not bundle or not os.path.isdir(bundle):
        raise TtrpcError(Code.INVALID_ARGUMENT, f"bundle {bundle!r} is not a directory")
    try:
        spec = paths.read_spec(bundle)
    except (ValueError, OSError) as exc:
        raise TtrpcError(Code.INVALID_ARGUMENT,
                         f"bundle {bundle}: config.json is not a readable OCI spec: {exc}")
    if not isinstance(spec, dict):
        raise TtrpcError(Code.INVALID_ARGUMENT, f"bundle {bundle} has no OCI spec (config.json)")
    return spec

