"""Frozen dataclasses to JSON and back, every field checked against its type hint: the
shape of sandbox.json (shim/host/podstate.py) and of the network worker's answers
(shim/network/remote.py). Standard library only: the daemon reads a worker's answer
before it has loaded anything of the pod's model."""
from __future__ import annotations

import collections.abc
import dataclasses
import functools
import json
import types
import typing
from typing import Any, Mapping


class ShapeError(ValueError):
    """JSON that is not the dataclass's shape; the message names where it came from."""


def to_json(value: object) -> object:
    """`value` as JSON: a dataclass as an object of its fields, tuples as lists."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_json(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {k: to_json(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [to_json(v) for v in value]
    return value


def dataclass_from_json(cls: type, data: object, where: str) -> Any:
    """A dataclass from its JSON object, every field checked against its type hint;
    ShapeError, naming `where`, for anything else (a value its class refuses too)."""
    if not isinstance(data, dict):
        raise ShapeError(f"{where}: expected an object, not {_kind(data)}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ShapeError(f"{where}: unknown field(s) {', '.join(unknown)}")
    hints = _hints(cls)
    values = {}
    for name, f in fields.items():
        if name in data:
            values[name] = _value(hints[name], data[name], f"{where}: {name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ShapeError(f"{where}: missing field {name}")
    try:
        return cls(**values)
    except (TypeError, ValueError) as exc:
        raise ShapeError(f"{where}: {exc}") from None


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """Once per class: get_type_hints compiles every annotation string anew (most of the
    time a load takes, which the node monitor pays per sandbox per scrape)."""
    return typing.get_type_hints(cls)


def _value(hint: Any, value: object, where: str) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (hint,) = [a for a in args if a is not type(None)]
        return _value(hint, value, where)
    if dataclasses.is_dataclass(hint):
        return dataclass_from_json(hint, value, where)
    if origin is tuple and isinstance(value, list):
        return tuple(_value(args[0], v, f"{where}[{i}]") for i, v in enumerate(value))
    if origin in (collections.abc.Mapping, dict) and isinstance(value, dict):
        return {_value(args[0], k, where): _value(args[1], v, f"{where}[{k}]")
                for k, v in value.items()}
    if hint is Any:
        return value
    if hint is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if hint in (int, str, bool) and type(value) is hint:
        return value
    raise ShapeError(f"{where}: expected {_name(hint)}, not {_kind(value)}")


def _name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint)


def _kind(value: object) -> str:
    return f"{type(value).__name__} {json.dumps(value)[:60]}" if value is not None else "null"
