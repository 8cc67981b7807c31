"""TOML text from what tomllib reads (the standard library reads TOML but does not write
it): tables as [headers], arrays of tables and tables in arrays inline. `dumps` checks
its own output by reading it back, so a value it cannot write faithfully is an error,
not a silently different file."""
from __future__ import annotations

import datetime
import json
import re
import tomllib
from typing import Any

_BARE = re.compile(r"[A-Za-z0-9_-]+")


class TomlWriteError(ValueError):
    pass


def dumps(data: dict[str, Any], head: str = "") -> str:
    text = head + "\n".join(_table(data, [])) + "\n"
    if tomllib.loads(text) != data:
        raise TomlWriteError("the TOML written does not read back as the data given")
    return text


def key(name: str) -> str:
    return name if _BARE.fullmatch(name) else string(name)


def _table(table: dict[str, Any], path: list[str]) -> list[str]:
    scalars = [(k, v) for k, v in table.items() if not isinstance(v, dict)]
    children = [(k, v) for k, v in table.items() if isinstance(v, dict)]
    lines: list[str] = []
    if path and (scalars or not children):
        lines.append("[" + ".".join(key(p) for p in path) + "]")
    lines += [f"{key(k)} = {_value(v)}" for k, v in scalars]
    for k, v in children:
        lines += ([""] if lines else []) + _table(v, path + [k])
    return lines


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return string(value)
    if isinstance(value, (datetime.datetime, datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, list):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key(k)} = {_value(v)}" for k, v in value.items()) + "}"
    raise TomlWriteError(f"cannot write {type(value).__name__} as TOML")


def string(value: str) -> str:
    return json.dumps(value, ensure_ascii=False)
