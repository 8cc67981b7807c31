"""What a VMM process (QEMU, virtiofsd) writes to its stdout and stderr, kept on the host
at a bounded size: `qemu.log`, `virtiofsd.log`. A guest can make QEMU log without
taking it over (a device it drives wrongly: a warning a request), and a file QEMU's
stderr were would grow with each one until the node's /run is full. So the VMM writes
a pipe, and the shim copies it into a CappedLog (shim/vm/cappedlog.py): never more than
LOG_MAX_BYTES, the newest output kept, the file reached through descriptors only.

What a child says between fork and exec (the jail that cannot be made,
shim/vm/qemu/jail.py) is in the pipe when the spawn fails: drain() copies it before the
log is quoted (tail()). The copy ends by itself when every writer is gone (the VMM and
its children exited); a shim that is gone leaves the VMM a pipe without a reader, whose
writes fail (QEMU and virtiofsd ignore SIGPIPE) instead of filling anything."""
from __future__ import annotations

import asyncio
import logging
import os

from . import workdir
from .cappedlog import CappedLog

log = logging.getLogger("podvm.qemu")

LOG_MAX_BYTES = 256 << 10
"""As the console's default cap: QEMU's and virtiofsd's own words are a few lines."""
_CHUNK = 64 << 10
_ROUND = 16  # chunks a call copies at most: a VMM that writes without end cannot hold the loop


def room_for(console_log_max_kib: int) -> int:
    """The bytes a VM's logs take at most: the console's and QEMU's and virtiofsd's own,
    each twice (a log past its cap is replaced by a new file, made before the old goes)."""
    return 2 * ((console_log_max_kib << 10) + 2 * LOG_MAX_BYTES)


class PipeLog:
    """A pipe whose write end (`fileno()`) a VMM gets as stdout and stderr, copied into
    `path` at most `max_bytes`. Pass it to the spawn, then close() the shim's write end."""

    def __init__(self, path: str, max_bytes: int = LOG_MAX_BYTES) -> None:
        self.path = path
        self._log: CappedLog | None = CappedLog(path, max_bytes)
        self._read, self._write = os.pipe2(os.O_CLOEXEC)
        os.set_blocking(self._read, False)
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._read, self.drain)

    def fileno(self) -> int:
        return self._write

    def close(self) -> None:
        """The shim's write end closed (after the spawn: the VMM has its own)."""
        if self._write >= 0:
            os.close(self._write)
            self._write = -1

    def drain(self) -> None:
        """What the VMM wrote so far copied into the log (the loop calls it as output
        comes; a caller about to quote the log calls it after the VMM ended)."""
        for _ in range(_ROUND):
            if self._read < 0:
                return
            try:
                data = os.read(self._read, _CHUNK)
            except BlockingIOError:
                return
            if not data:
                self._end()
                return
            if self._log is None:
                continue  # no longer kept: still read, or the VMM would block on a full pipe
            try:
                self._log.write(data)
            except OSError as exc:
                log.warning("%s: %s; no longer kept", self.path, exc)
                self._log.close_file()
                self._log = None

    def _end(self) -> None:
        """Every writer gone: the copy ends, the log file stays."""
        self._loop.remove_reader(self._read)
        os.close(self._read)
        self._read = -1
        self.close()
        if self._log is not None:
            self._log.close_file()
            self._log = None


def tail(path: str, size: int = 600) -> str:
    """The end of the file at `path` on one line ("" when it cannot be read). The logs
    are in QEMU's work directory, which QEMU can write: read beneath it, never through
    a link (QEMU's `qemu.log -> /etc/shadow` would be quoted to containerd) nor from a
    FIFO (which would hold the shim)."""
    try:
        data = workdir.read_tail(path, size)
    except OSError:
        return ""
    return data.decode(errors="replace").strip().replace("\n", " | ")
