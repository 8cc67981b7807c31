"""The guest's end of a port forward: a TCP connection to a port on the pod's loopback,
whose bytes the shim carries to and from the host connection containerd made.

The pod's network namespace in the guest is the agent's own (containers and the pod's
namespace holder do not unshare the network: the guest's interfaces are the pod's), so
the agent connects from where it runs. 127.0.0.1 first, as containerd's own dial
(tcp4 first), then ::1 for a server that listens on IPv6 only.

Flow control: asyncio's streams pause reading from the guest socket when their buffer
is full (64 KiB) and a write answers only once the socket has drained to its limit, so
a slow reader on either side stops the other instead of filling memory."""
from __future__ import annotations

import asyncio
import itertools
import logging

from podvm_core.ttrpc import Code, TtrpcError

log = logging.getLogger("podvm.agent")

ADDRESSES = ("127.0.0.1", "::1")
CONNECT_TIMEOUT = 10
READ_DEFAULT = 65536
READ_MAX = 1 << 20  # well under ttrpc's 4 MiB frame


class PortForwards:
    """The open connections, by stream id."""

    def __init__(self) -> None:
        self._streams: dict[int, tuple[int, asyncio.StreamReader, asyncio.StreamWriter]] = {}
        self._ids = itertools.count(1)

    def __len__(self) -> int:
        return len(self._streams)

    async def open(self, port: int) -> tuple[int, str]:
        """A new stream connected to `port`: its id and the address that answered.
        UNAVAILABLE when neither loopback address takes the connection."""
        if not 1 <= port <= 65535:
            raise TtrpcError(Code.INVALID_ARGUMENT, f"port {port} is not a TCP port (1-65535)")
        refusals = []
        for address in ADDRESSES:
            try:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection(address, port), CONNECT_TIMEOUT)
            except OSError as exc:
                refusals.append(f"{address}: {exc.strerror or exc}")
                continue
            except asyncio.TimeoutError:
                refusals.append(f"{address}: no answer within {CONNECT_TIMEOUT} s")
                continue
            stream_id = next(self._ids)
            self._streams[stream_id] = (port, reader, writer)
            log.info("port forward %d: connected to %s port %d (%d open)", stream_id,
                     address, port, len(self._streams))
            return stream_id, address
        log.info("port forward to port %d refused: %s", port, "; ".join(refusals))
        raise TtrpcError(Code.UNAVAILABLE, f"nothing in the pod accepts connections on port "
                                           f"{port} ({'; '.join(refusals)})")

    def _get(self, stream_id: int) -> tuple[int, asyncio.StreamReader, asyncio.StreamWriter]:
        found = self._streams.get(stream_id)
        if found is None:
            raise TtrpcError(Code.NOT_FOUND, f"port forward {stream_id} is not open")
        return found

    async def read(self, stream_id: int, max_bytes: int) -> bytes:
        """Up to `max_bytes` from the guest's side; b"" at its end (or a reset)."""
        _, reader, _ = self._get(stream_id)
        try:
            return await reader.read(min(max_bytes or READ_DEFAULT, READ_MAX))
        except OSError as exc:
            log.info("port forward %d: read: %s", stream_id, exc)
            return b""

    async def write(self, stream_id: int, data: bytes) -> int:
        """All of `data`, answered once the socket took it."""
        _, _, writer = self._get(stream_id)
        try:
            writer.write(data)
            await writer.drain()
        except (OSError, RuntimeError) as exc:  # RuntimeError: written after our close
            raise TtrpcError(Code.UNAVAILABLE, f"port forward {stream_id}: the guest's side "
                                               f"is closed ({exc})") from None
        return len(data)

    def close(self, stream_id: int, write_only: bool) -> None:
        """End the host's direction (`write_only`), or the whole connection. Idempotent."""
        found = self._streams.get(stream_id)
        if found is None:
            return
        port, _, writer = found
        if write_only:
            try:
                if writer.can_write_eof() and not writer.is_closing():
                    writer.write_eof()
            except OSError:
                pass
            return
        del self._streams[stream_id]
        writer.close()
        log.info("port forward %d to port %d closed (%d open)", stream_id, port,
                 len(self._streams))
