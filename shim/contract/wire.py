"""protobuf's wire format, the few parts `start` and `delete` write and read by hand:
both run once per container, and loading protobuf would cost each of them more than all
they do (bootstrap.py, delete.py)."""
from __future__ import annotations

VARINT = 0
LEN = 2
"""Wire types: a varint (integers, enums, booleans); length-delimited (strings, bytes,
messages)."""


def read_varint(data: bytes, at: int) -> tuple[int, int]:
    """The varint at `data[at:]` and where it ends; IndexError where it runs past the end."""
    value = shift = 0
    while True:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
        shift += 7


def varint(value: int) -> bytes:
    """A non-negative integer's varint."""
    if value < 0:
        raise ValueError(f"no varint here for a negative number: {value}")
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def varint_field(number: int, value: int) -> bytes:
    """Field `number` holding the integer `value`; nothing for 0, as proto3 writes it."""
    return varint(number << 3 | VARINT) + varint(value) if value else b""


def len_field(number: int, data: bytes) -> bytes:
    """Field `number` holding `data` (a string's bytes, a message serialized)."""
    return varint(number << 3 | LEN) + varint(len(data)) + data
