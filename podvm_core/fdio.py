"""Non-blocking reads and writes of pipes, ptys and FIFOs, awaited on the event loop:
the shim's copies to and from containerd's FIFOs and the agent's container stdio both
wait here, never in a blocking call."""
from __future__ import annotations

import asyncio
import errno
import os

CHUNK = 64 * 1024
"""What one read asks for unless told: a pipe's default capacity."""


class FdStream:
    """An fd this object owns (set non-blocking, closed by `close`). A read and a write
    may wait at once (a pty is both a process's stdin and its stdout), as may several
    readers; the fd is watched by the loop only while someone waits."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._waiting: tuple[set[asyncio.Future[None]], set[asyncio.Future[None]]] = (
            set(), set())  # (readers, writers)
        os.set_blocking(fd, False)

    async def read(self, size: int = CHUNK) -> bytes:
        """Up to `size` bytes; b"" at end of stream, once a pty's other side closed, or
        when closed meanwhile."""
        while self.fd >= 0:
            try:
                return os.read(self.fd, size)
            except BlockingIOError:
                await self._ready(writing=False)
            except OSError as exc:
                if exc.errno == errno.EIO:  # a pty whose other side closed
                    return b""
                raise
        return b""

    async def read_all(self) -> bytes:
        """Everything up to end of stream."""
        chunks = []
        while data := await self.read():
            chunks.append(data)
        return b"".join(chunks)

    async def write(self, data: bytes) -> int:
        """All of `data`, waiting while the fd is full; the count written falls short only
        when closed meanwhile."""
        view = memoryview(data)
        while view and self.fd >= 0:
            try:
                view = view[os.write(self.fd, view):]
            except BlockingIOError:
                await self._ready(writing=True)
        return len(data) - len(view)

    def close(self) -> None:
        """Close the fd, first waking whatever waits on it and unwatching it."""
        if self.fd < 0:
            return
        fd, self.fd = self.fd, -1
        for writing, waiters in enumerate(self._waiting):
            if waiters:
                _unwatch(next(iter(waiters)).get_loop(), fd, bool(writing))
                _wake(waiters)
        os.close(fd)

    async def _ready(self, writing: bool) -> None:
        loop = asyncio.get_running_loop()
        fd, waiters = self.fd, self._waiting[writing]
        if not waiters:
            (loop.add_writer if writing else loop.add_reader)(fd, _wake, waiters)
        future = loop.create_future()
        waiters.add(future)
        try:
            await future
        finally:
            waiters.discard(future)
            if not waiters and self.fd == fd:  # else close() unwatched it
                _unwatch(loop, fd, writing)


def _wake(waiters: set[asyncio.Future[None]]) -> None:
    for future in waiters:
        if not future.done():
            future.set_result(None)


def _unwatch(loop: asyncio.AbstractEventLoop, fd: int, writing: bool) -> None:
    (loop.remove_writer if writing else loop.remove_reader)(fd)
