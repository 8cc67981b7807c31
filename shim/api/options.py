"""The podvm configuration a pod is made with, loaded the same way for both APIs: from the
file containerd's runtime options name (a Task-API Create's `options`,
runtimeoptions.v1.Options.config_path; for a Sandbox-API pod, those `start` kept in the
bundle), else the default one."""
from __future__ import annotations

import os

from google.protobuf.any_pb2 import Any
from google.protobuf.message import DecodeError
from google.protobuf.unknown_fields import UnknownFieldSet
from google.protobuf.wrappers_pb2 import BytesValue

from podvm_core.pb.containerd.runtimeoptions.v1.api_pb2 import Options
from podvm_core.ttrpc import Code, TtrpcError

from .. import config
from ..host import paths

RUNTIME_OPTIONS = "runtimeoptions.v1.Options"
_BOOTSTRAP_EXTENSIONS = 8
_LENGTH_DELIMITED = 2


def load_config(options=None) -> config.Config:
    """`options`: an Any holding containerd's runtime options, or None."""
    config_path = ""
    if options is not None and options.type_url.endswith(RUNTIME_OPTIONS):
        try:
            config_path = Options.FromString(options.value).config_path
        except DecodeError as exc:
            raise TtrpcError(Code.INVALID_ARGUMENT,
                             f"runtime options from containerd: {exc}") from None
    try:
        return config.load(config_path)
    except config.ConfigError as exc:
        raise TtrpcError(Code.INVALID_ARGUMENT, f"podvm configuration: {exc}") from None


def saved_options(bundle: str) -> Any | None:
    """The runtime options `start` kept in `bundle` (containerd gives the Sandbox API no
    other way), or None when it got none. Anything but runtimeoptions.v1.Options is an
    error here, where the Task API ignores it: these options exist only for podvm."""
    if not bundle:
        return None
    path = os.path.join(bundle, paths.RUNTIME_OPTIONS_FILE)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise TtrpcError(Code.INVALID_ARGUMENT,
                         f"runtime options {path}: cannot read: {exc.strerror}") from None
    try:
        options = _runtime_options(data)
        if options is not None:
            Options.FromString(options.value)
    except (DecodeError, ValueError) as exc:
        raise TtrpcError(Code.INVALID_ARGUMENT, f"runtime options from containerd "
                         f"({path}): {exc}") from None
    return options


def _runtime_options(stdin: bytes) -> Any | None:
    """What containerd wrote to `start`'s stdin (pkg/shim/util.go in containerd): before
    2.3, the options themselves, an Any (fields 1 and 2 only); from 2.3, BootstrapParams
    (api/runtime/bootstrap/v1 there: its scalars from field 3 on), the options one of its
    extensions (field 8, each an Extension whose field 1 is an Any), among others that a
    shim ignores. Read through Any and BytesValue, which have the same wire layout (a
    field above 2 makes it BootstrapParams, as `start` tells them apart: bootstrap.py)."""
    message = Any.FromString(stdin)
    unknown = UnknownFieldSet(message)
    if all(field.field_number <= 2 for field in unknown):
        if not message.type_url.endswith(RUNTIME_OPTIONS):
            raise ValueError(f"of type {message.type_url or '(none)'!r}, "
                             f"not {RUNTIME_OPTIONS}")
        return message
    for field in unknown:
        if field.field_number == _BOOTSTRAP_EXTENSIONS and field.wire_type == _LENGTH_DELIMITED:
            extension = Any.FromString(BytesValue.FromString(field.data).value)
            if extension.type_url.endswith(RUNTIME_OPTIONS):
                return extension
    return None
