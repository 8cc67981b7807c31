"""Non-blocking reads and writes on pipe and pty fds, awaited on the event loop."""
from __future__ import annotations

import asyncio
import errno
import os


class Stream:
    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._waiting: asyncio.Future | None = None
        os.set_blocking(fd, False)

    async def _ready(self, add, remove) -> None:
        future = self._waiting = asyncio.get_running_loop().create_future()
        fd = self.fd
        add(fd, lambda: future.done() or future.set_result(None))
        try:
            await future
        finally:
            self._waiting = None
            if self.fd == fd:
                remove(fd)

    async def read(self, size: int) -> bytes:
        """Up to `size` bytes; b"" at end of stream (or when closed meanwhile)."""
        loop = asyncio.get_running_loop()
        while self.fd >= 0:
            try:
                return os.read(self.fd, size)
            except BlockingIOError:
                await self._ready(loop.add_reader, loop.remove_reader)
            except OSError as exc:
                if exc.errno == errno.EIO:  # a pty whose other side closed
                    return b""
                raise
        return b""

    async def write(self, data: bytes) -> int:
        loop = asyncio.get_running_loop()
        view = memoryview(data)
        while view and self.fd >= 0:
            try:
                view = view[os.write(self.fd, view):]
            except BlockingIOError:
                await self._ready(loop.add_writer, loop.remove_writer)
        return len(data) - len(view)

    def close(self) -> None:
        if self.fd < 0:
            return
        fd, self.fd = self.fd, -1
        loop = asyncio.get_running_loop()
        loop.remove_reader(fd)
        loop.remove_writer(fd)
        if self._waiting is not None and not self._waiting.done():
            self._waiting.set_result(None)
        os.close(fd)
