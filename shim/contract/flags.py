"""The shim's command line, exactly as containerd writes it: Go-style single-dash flags
before an optional subcommand (`start`, `delete`; none = serve as the daemon)."""
from __future__ import annotations

import os

USAGE = """\
usage: containerd-shim-podvm-v2 [flags] [start|delete]

containerd runs this binary for the runtime type io.containerd.podvm.v2; people rarely do.

subcommands:
  start     start (or reuse) the shim daemon of the container's pod and print its address
  delete    clean up after a container whose shim is gone; prints a DeleteResponse
  (none)    serve as the shim daemon (what `start` runs, with the socket on fd 3)

flags:
  -namespace NS        containerd namespace of the container
  -id ID               container id
  -address PATH        containerd's gRPC socket
  -publish-binary EXE  containerd binary used to publish events when ttrpc is unavailable
  -bundle PATH         OCI bundle directory (default: the working directory)
  -socket ADDR         the daemon's own ttrpc address (set by `start`)
  -debug               log at debug level
  -info                print the runtime's info and features (a protobuf RuntimeInfo, as
                       containerd 2.x reads it) and exit
  -v, -version         print the version and exit
  -h, -help            print this help and exit
"""

_VALUE_FLAGS = {"namespace", "id", "address", "publish-binary", "bundle", "socket"}
_BOOL_FLAGS = {"debug", "info", "v", "version", "h", "help"}


class UsageError(Exception):
    pass


_FIELDS = ("namespace", "id", "address", "publish_binary", "bundle", "socket", "debug",
           "info", "version", "help", "action")
_DEFAULTS = ("", "", "", "", "", "", False, False, False, False, "serve")


# A plain class, neither a dataclass (inspect, ast, dis and tokenize: ~7 ms of every
# `start`) nor a named tuple (collections, with functools and operator: ~3 ms).
class Flags:
    """The command line: strings `namespace`, `id`, `address`, `publish_binary`, `bundle`,
    `socket`, `action` ("serve", "start" or "delete"); booleans `debug`, `info`,
    `version`, `help`. Immutable; `_replace(...)` gives a changed copy, `_asdict()` the
    fields (as a named tuple's)."""

    __slots__ = _FIELDS
    _fields = _FIELDS
    _field_defaults = dict(zip(_FIELDS, _DEFAULTS))

    def __init__(self, **values: object) -> None:
        unknown = sorted(set(values) - set(_FIELDS))
        if unknown:
            raise TypeError(f"no such flags: {', '.join(unknown)}")
        for name, default in zip(_FIELDS, _DEFAULTS):
            object.__setattr__(self, name, values.get(name, default))

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"flags are immutable: {name}")

    def _replace(self, **changes: object) -> "Flags":
        return Flags(**{**self._asdict(), **changes})

    def _asdict(self) -> dict[str, object]:
        return {name: getattr(self, name) for name in _FIELDS}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Flags) and self._asdict() == other._asdict()

    def __hash__(self) -> int:
        return hash(tuple(self._asdict().values()))

    def __repr__(self) -> str:
        return "Flags(" + ", ".join(f"{k}={v!r}" for k, v in self._asdict().items()) + ")"

    @property
    def bundle_dir(self) -> str:
        return self.bundle or os.getcwd()


def parse(argv: list[str]) -> Flags:
    values: dict[str, object] = {}
    args = iter(argv)
    rest: list[str] = []
    for arg in args:
        if not arg.startswith("-") or arg in ("-", "--"):
            rest.append(arg)
            rest.extend(args)
            break
        name, eq, value = arg.lstrip("-").partition("=")
        if name in _BOOL_FLAGS:
            values[name] = value.lower() not in ("false", "0") if eq else True
        elif name in _VALUE_FLAGS:
            if not eq:
                try:
                    value = next(args)
                except StopIteration:
                    raise UsageError(f"flag needs an argument: -{name}") from None
            values[name.replace("-", "_")] = value
        else:
            raise UsageError(f"flag provided but not defined: -{name}")
    if rest and rest[0] == "--":
        rest = rest[1:]
    if len(rest) > 1:
        raise UsageError(f"unexpected arguments after {rest[0]}: {' '.join(rest[1:])}")
    if rest and rest[0] not in ("start", "delete"):
        raise UsageError(f"unknown subcommand {rest[0]!r}: expected start or delete")
    version = bool(values.pop("v", False) or values.pop("version", False))
    help_ = bool(values.pop("h", False) or values.pop("help", False))
    return Flags(**values, version=version, help=help_,  # type: ignore[arg-type]
                 action=rest[0] if rest else "serve")
