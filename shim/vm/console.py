"""The guest's serial console, kept on the host at a bounded size.

QEMU writes the console to a socket (a chardev with server=on, wait=off) that the shim
connects to before the guest runs, on a boot and on a template's restore alike; this
reader copies it into `console.log`, which holds only the newest bytes: never more than
the configured cap ([hypervisor.qemu] console_log_max_kib), and once the cap was
reached, at least half of it. So a guest that writes its console forever costs the host
a bounded file in /run and the copying, and the log still ends with what the guest said
last, for the error messages that quote it (shim/vm/qemu.py's console_tail) and
for `delete` and `podvmctl`, which read the file after the shim.

A compaction rewrites the file's newest half in one rename (podvm_core/atomic.py): a
reader sees the old file or the new one, never a part. It happens once per half a cap
of output, so copying costs at most about three writes per byte the guest sends. When
the shim is gone, QEMU drops what the guest writes (no client on the socket), and the
guest is never held up by a console nobody reads.

QEMU can write the directory the log is in, and plant any name there: the log is
reached through descriptors alone (shim/vm/workdir.py), each new file made under a name
nobody can guess and renamed over the log's, the newest half read back from the file
this writer holds, so no name QEMU plants is followed or opened. The same writer keeps
QEMU's and virtiofsd's own output (shim/vm/vmmlog.py)."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os

from podvm_core.atomic import replace_at

from . import workdir

log = logging.getLogger("podvm.qemu")

_CHUNK = 64 << 10


class ConsoleLog:
    """`path` holding at most `max_bytes` of the newest output; `write()` adds output."""

    def __init__(self, path: str, max_bytes: int) -> None:
        if max_bytes < 2:
            raise ValueError(f"a console log needs room for at least 2 bytes, got {max_bytes}")
        self.path = path
        self.max_bytes = max_bytes
        self._name = os.path.basename(path)
        self._dir, self._fd = workdir.create(path)  # a new log per launch, as QEMU's was
        self._size = 0
        self._task: asyncio.Task | None = None
        self._writer: asyncio.StreamWriter | None = None

    @classmethod
    async def attach(cls, socket_path: str, path: str, max_bytes: int) -> "ConsoleLog":
        """Connected to QEMU's console socket, copying into `path` until it closes."""
        with workdir.socket_path(socket_path) as sock:
            reader, writer = await asyncio.open_unix_connection(sock)
        console = cls(path, max_bytes)
        console._writer = writer
        console._task = asyncio.create_task(console._copy(reader))
        return console

    def write(self, data: bytes) -> None:
        if self._size + len(data) <= self.max_bytes:
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view):]
            self._size += len(data)
            return
        half = self.max_bytes // 2
        if len(data) >= half:
            kept = data[-self.max_bytes:]
        else:
            kept = self._tail(half - len(data)) + data
        fd = replace_at(self._dir, self._name, kept)
        os.close(self._fd)
        self._fd = fd
        self._size = len(kept)

    def _tail(self, size: int) -> bytes:
        """From the file this writer holds, not from the name (QEMU may have moved it)."""
        return os.pread(self._fd, size, max(0, self._size - size))

    async def _copy(self, reader: asyncio.StreamReader) -> None:
        """Until QEMU closes the socket. A log that cannot be written (its directory
        removed under it) is no longer kept, but the socket is still read: QEMU would
        otherwise hold the guest's console, and with it the guest's kernel."""
        kept = True
        with contextlib.suppress(ConnectionError, OSError):  # QEMU gone: as an end
            while data := await reader.read(_CHUNK):
                if not kept:
                    continue
                try:
                    self.write(data)
                except OSError as exc:
                    kept = False
                    log.warning("guest console log %s: %s; no longer kept", self.path, exc)

    async def finished(self, grace: float) -> None:
        """Wait up to `grace` seconds for QEMU's end of the console (after it exited:
        the last lines are in the file then)."""
        if self._task is not None and not self._task.done():
            await asyncio.wait([self._task], timeout=grace)

    async def close(self, grace: float = 1.0) -> None:
        """After QEMU stopped: what it wrote last is copied (up to `grace` seconds)."""
        await self.finished(grace)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._writer is not None:
            self._writer.close()
        self.close_file()

    def close_file(self) -> None:
        """The log's descriptors closed (the file stays, for the messages that quote it)."""
        for fd in (self._fd, self._dir):
            if fd >= 0:
                os.close(fd)
        self._fd = self._dir = -1
