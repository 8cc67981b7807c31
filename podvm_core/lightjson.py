"""JSON through the standard library's C accelerator (_json) alone: the `json` package's
own modules import `re` (and with it `enum`), about 8 ms of every `start` and `delete`,
which read and write a few small JSON files (the bundle's config.json, shim.json). The
same values, the same text as json.loads and json.dumps with their defaults."""
from __future__ import annotations

try:
    import _json
except ImportError:  # a Python built without it: json's own, all the same
    _json = None

_WHITESPACE = " \t\n\r"


class _Options:
    """What json's C scanner reads of a JSONDecoder (json.loads' defaults)."""
    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int
    parse_constant = {"-Infinity": float("-inf"), "Infinity": float("inf"),
                      "NaN": float("nan")}.__getitem__


def _no_default(value: object) -> object:
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


if _json is not None:
    _scan = _json.make_scanner(_Options())


def loads(data: bytes | str) -> object:
    """json.loads of one UTF-8 document; ValueError where it is not one."""
    text = data.decode("utf-8") if isinstance(data, (bytes, bytearray)) else data
    if _json is None:
        import json  # here: only a Python without _json takes json's own

        return json.loads(text)
    if text.startswith("\ufeff"):
        raise ValueError("Unexpected UTF-8 BOM (decode using utf-8-sig)")
    at = _skip(text, 0)
    try:
        value, at = _scan(text, at)
    except StopIteration as exc:
        raise ValueError(f"Expecting value: char {exc.value}") from None
    if _skip(text, at) != len(text):
        raise ValueError(f"Extra data: char {at}")
    return value


def dumps(value: object) -> str:
    """json.dumps(value), its defaults."""
    if _json is None:
        import json  # here: only a Python without _json takes json's own

        return json.dumps(value)
    if isinstance(value, str):
        return _json.encode_basestring_ascii(value)
    # a new encoder each time, as json.dumps makes: its markers (the cycle check) are its own
    encode = _json.make_encoder({}, _no_default, _json.encode_basestring_ascii, None, ": ",
                                ", ", False, False, True)
    return "".join(encode(value, 0))


def _skip(text: str, at: int) -> int:
    while at < len(text) and text[at] in _WHITESPACE:
        at += 1
    return at
