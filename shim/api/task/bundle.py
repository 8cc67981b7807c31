"""What a Create brings besides its request: the bundle's OCI spec and the podvm
configuration that containerd's runtime options name."""
from __future__ import annotations

import os

from podvm_core.pb.containerd.runtimeoptions.v1.api_pb2 import Options
from podvm_core.ttrpc import Code, TtrpcError

from ... import config
from ...host import paths

RUNTIME_OPTIONS = "runtimeoptions.v1.Options"


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


def load_config(options) -> config.Config:
    config_path = ""
    if options.type_url.endswith(RUNTIME_OPTIONS):
        config_path = Options.FromString(options.value).config_path
    try:
        return config.load(config_path)
    except config.ConfigError as exc:
        raise TtrpcError(Code.INVALID_ARGUMENT, f"podvm configuration: {exc}") from None
