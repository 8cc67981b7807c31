"""The podvm configuration a pod is made with, loaded the same way for both APIs: from the
file containerd's runtime options name (a Task-API Create's `options`,
runtimeoptions.v1.Options.config_path), else the default one (a Sandbox-API pod)."""
from __future__ import annotations

from podvm_core.pb.containerd.runtimeoptions.v1.api_pb2 import Options
from podvm_core.ttrpc import Code, TtrpcError

from .. import config

RUNTIME_OPTIONS = "runtimeoptions.v1.Options"


def load_config(options=None) -> config.Config:
    """`options`: an Any holding containerd's runtime options, or None."""
    config_path = ""
    if options is not None and options.type_url.endswith(RUNTIME_OPTIONS):
        config_path = Options.FromString(options.value).config_path
    try:
        return config.load(config_path)
    except config.ConfigError as exc:
        raise TtrpcError(Code.INVALID_ARGUMENT, f"podvm configuration: {exc}") from None
