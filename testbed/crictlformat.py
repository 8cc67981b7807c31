"""What crictl reads and prints, and how it fails, for the commands of testbed/crictl.py:
pod and container configs from JSON (or YAML), tables, units and protobuf JSON laid out as
crictl's, and its `FATA[0000]` errors."""
from __future__ import annotations

import contextlib
import io
import json
import sys
import time
from contextvars import ContextVar
from typing import Any, Iterable, Iterator, TextIO

from google.protobuf import json_format, message

from .criclient import CriError


class Fatal(Exception):
    """An error crictl reports with `FATA[0000] ...` and exit status 1."""


class ExitCode(Exception):
    """Leave with this status and nothing more to print (exec's command failed)."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def for_each_id(ids: list[str], what: str, fn) -> None:
    """Run fn per ID; like crictl, report the first failure after trying all."""
    errors = []
    for ident in ids:
        try:
            fn(ident)
        except CriError as exc:
            errors.append(f"{what} {ident!r}: {exc}")
    if errors:
        raise Fatal("; ".join(errors))


def truncate_id(ident: str, prefix: str = "") -> str:
    """The 13-character ID crictl shows in tables (after an optional prefix like sha256:)."""
    if prefix and ident.startswith(prefix):
        ident = ident[len(prefix):]
    return ident[:13]


def human_duration(seconds: float) -> str:
    """docker/go-units HumanDuration, which crictl's CREATED column uses."""
    s = int(seconds)
    if s < 1:
        return "Less than a second"
    if s == 1:
        return "1 second"
    if s < 60:
        return f"{s} seconds"
    minutes, hours = s // 60, s // 3600
    if minutes == 1:
        return "About a minute"
    if minutes < 60:
        return f"{minutes} minutes"
    if hours == 1:
        return "About an hour"
    if hours < 48:
        return f"{hours} hours"
    if hours < 24 * 7 * 2:
        return f"{hours // 24} days"
    if hours < 24 * 30 * 2:
        return f"{hours // 24 // 7} weeks"
    if hours < 24 * 365 * 2:
        return f"{hours // 24 // 30} months"
    return f"{hours // 24 // 365} years"


def ago(created_ns: int) -> str:
    return human_duration(time.time() - created_ns / 1e9) + " ago"


def human_size(size: float) -> str:
    """docker/go-units HumanSize: decimal units, four significant digits."""
    units = ["B", "kB", "MB", "GB", "TB", "PB", "EB", "ZB", "YB"]
    i = 0
    while size >= 1000 and i < len(units) - 1:
        size /= 1000.0
        i += 1
    return f"{size:.4g}{units[i]}"


def table(header: list[str], rows: Iterable[list[str]]) -> str:
    """Columns as Go's tabwriter lays out crictl's tables (min width 20, padding 3)."""
    rows = [header, *rows]
    widths = [max(20, max(len(r[i]) for r in rows) + 3) for i in range(len(header) - 1)]
    lines = []
    for r in rows:
        cells = [c.ljust(w) for c, w in zip(r, widths)] + [r[-1]]
        lines.append("".join(cells).rstrip())
    return "\n".join(lines) + "\n"


def to_dict(msg: message.Message) -> dict:
    """Protobuf JSON as crictl prints it: camelCase names, fields at their defaults too,
    in the order the .proto declares them."""
    return _in_field_order(msg.DESCRIPTOR, json_format.MessageToDict(
        msg, always_print_fields_with_no_presence=True))


def _in_field_order(desc, value: Any) -> Any:
    if not isinstance(value, dict):
        return value
    out = {}
    for field in desc.fields:
        if field.json_name not in value:
            continue
        v = value[field.json_name]
        sub = field.message_type
        if sub is not None and sub.GetOptions().map_entry:
            value_field = sub.fields_by_name["value"]
            if value_field.message_type is not None:
                v = {k: _in_field_order(value_field.message_type, x) for k, x in v.items()}
        elif sub is not None and isinstance(v, list):
            v = [_in_field_order(sub, x) for x in v]
        elif sub is not None:
            v = _in_field_order(sub, v)
        out[field.json_name] = v
    out.update((k, v) for k, v in value.items() if k not in out)  # well-known types' keys
    return out


def status_info(status: message.Message, info: dict[str, str] | None = None) -> str:
    """crictl's inspect layout: {"status": ..., <each info key>: its value, parsed when it
    is JSON}."""
    out: dict[str, Any] = {"status": to_dict(status)}
    for key in sorted(info or {}):
        try:
            out[key] = json.loads(info[key])  # type: ignore[index]
        except ValueError:
            out[key] = info[key]  # type: ignore[index]
    return json.dumps(out, indent=2)


_STREAMS: ContextVar[tuple[TextIO, TextIO] | None] = ContextVar("crictl_streams",
                                                                default=None)
"""Where a command run in a test's process writes (captured()); None: the process's."""


def stdout() -> TextIO:
    streams = _STREAMS.get()
    return sys.stdout if streams is None else streams[0]


def stderr() -> TextIO:
    streams = _STREAMS.get()
    return sys.stderr if streams is None else streams[1]


@contextlib.contextmanager
def captured() -> Iterator[tuple[io.BytesIO, io.BytesIO]]:
    """What the commands write in this thread's context, caught: the bytes of their
    stdout and stderr, as a process's pipes would carry them."""
    out, err = io.BytesIO(), io.BytesIO()
    texts = (io.TextIOWrapper(out, write_through=True),
             io.TextIOWrapper(err, write_through=True))
    token = _STREAMS.set(texts)
    try:
        yield out, err
    finally:
        _STREAMS.reset(token)
        for text in texts:
            text.detach()  # the bytes stay the caller's to read


def write(text: str) -> None:
    out = stdout()
    out.write(text)
    out.flush()


def load_message(path: str, msg: message.Message) -> message.Message:
    """A CRI message from a JSON (or, with PyYAML, YAML) file, as crictl reads pod and
    container configs: snake_case or camelCase names, enums by name or number, unknown
    fields ignored."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError as exc:
        raise Fatal(f"load {path}: {exc.strerror}") from None
    try:
        data = json.loads(text)
    except ValueError as exc:
        try:
            import yaml  # type: ignore[import-untyped]
        except ImportError:
            raise Fatal(f"load {path}: not JSON ({exc}); YAML needs PyYAML") from None
        data = yaml.safe_load(text)
    try:
        return json_format.ParseDict(data, msg, ignore_unknown_fields=True)
    except json_format.ParseError as exc:
        raise Fatal(f"load {path}: not a {msg.DESCRIPTOR.name}: {exc}") from None
