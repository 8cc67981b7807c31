"""One exception hierarchy: an RPC error is a value with a status code."""
from __future__ import annotations

from .codes import Code


class TtrpcError(Exception):
    """An RPC answered (or to be answered) with a non-OK status."""

    def __init__(self, code: Code | int, message: str = "") -> None:
        self.code = Code(code)
        self.message = message
        super().__init__(f"{self.code.name}: {message}" if message else self.code.name)


class ConnectionClosed(Exception):
    """The peer went away (or we closed) while a call was outstanding."""
