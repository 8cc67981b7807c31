"""The guest's serial console, kept on the host at a bounded size.

QEMU writes the console to a socket (a chardev with server=on, wait=off) that the shim
connects to before the guest runs, on a boot and on a template's restore alike; this
reader copies it into `console.log`, a CappedLog (shim/vm/cappedlog.py): never more
than the configured cap ([hypervisor.qemu] console_log_max_kib), the newest bytes kept.
So a guest that writes its console forever costs the host a bounded file in /run and
the copying, and the log still ends with what the guest said last, for the error
messages that quote it (shim/vm/qemu/driver.py's console_tail). When the shim is gone, QEMU drops what
the guest writes (no client on the socket), and the guest is never held up by a
console nobody reads."""
from __future__ import annotations

import asyncio
import contextlib
import logging

from .. import workdir
from ..cappedlog import CappedLog

log = logging.getLogger("podvm.qemu")

_CHUNK = 64 << 10


class ConsoleLog:
    """QEMU's console socket copied into `log` until QEMU closes it."""

    def __init__(self, log: CappedLog, writer: asyncio.StreamWriter) -> None:
        self.log = log
        self._writer = writer
        self._task: asyncio.Task | None = None

    @classmethod
    async def attach(cls, socket_path: str, path: str, max_bytes: int) -> "ConsoleLog":
        """Connected to QEMU's console socket, copying into `path` until it closes."""
        with workdir.socket_path(socket_path) as sock:
            reader, writer = await asyncio.open_unix_connection(sock)
        console = cls(CappedLog(path, max_bytes), writer)
        console._task = asyncio.create_task(console._copy(reader))
        return console

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
                    self.log.write(data)
                except OSError as exc:
                    kept = False
                    log.warning("guest console log %s: %s; no longer kept", self.log.path, exc)

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
        self._writer.close()
        self.log.close_file()
