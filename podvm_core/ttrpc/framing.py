"""ttrpc frames: a 10-byte header (length, stream id, type, flags) and the data."""
from __future__ import annotations

import asyncio
import struct
from enum import IntEnum
from typing import NamedTuple

HEADER = struct.Struct(">IIBB")
HEADER_SIZE = HEADER.size
MAX_DATA = 4 << 20
_DRAIN_CHUNK = 64 << 10


class MessageType(IntEnum):
    REQUEST = 0x01
    RESPONSE = 0x02
    DATA = 0x03


FLAG_REMOTE_CLOSED = 0x01
FLAG_REMOTE_OPEN = 0x02
FLAG_NO_DATA = 0x04


class Frame(NamedTuple):  # not a dataclass: cheaper to make, per frame and at import
    stream_id: int
    type: int
    flags: int
    data: bytes
    oversized: int = 0
    """Length announced by a frame over MAX_DATA; its data was drained, not kept."""


def encode(stream_id: int, type_: int, data: bytes, flags: int = 0) -> bytes:
    if len(data) > MAX_DATA:
        raise ValueError(f"frame data of {len(data)} bytes exceeds {MAX_DATA}")
    return HEADER.pack(len(data), stream_id, type_, flags) + data


async def read_frame(reader: asyncio.StreamReader) -> Frame | None:
    """The next frame, or None on a clean end of stream between frames.

    A frame cut short raises asyncio.IncompleteReadError. An oversized frame is read
    past (so the connection stays in step) and returned with `oversized` set.
    """
    try:
        header = await reader.readexactly(HEADER_SIZE)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise
    length, stream_id, type_, flags = HEADER.unpack(header)
    if length > MAX_DATA:
        remaining = length
        while remaining:
            chunk = await reader.read(min(remaining, _DRAIN_CHUNK))
            if not chunk:
                raise asyncio.IncompleteReadError(b"", remaining)
            remaining -= len(chunk)
        return Frame(stream_id, type_, flags, b"", oversized=length)
    data = await reader.readexactly(length) if length else b""
    return Frame(stream_id, type_, flags, data)
