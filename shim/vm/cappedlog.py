"""A log file on the host kept at a bounded size: the guest's console
(shim/vm/qemu/console.py) and what QEMU and virtiofsd write themselves
(shim/vm/vmmlog.py).

The file holds only the newest bytes: never more than its cap, and once the cap was
reached, at least half of it. So whatever writes without end costs the host a bounded
file in /run, and the log still ends with what was said last, for the error messages
that quote it.

A compaction rewrites the file's newest half in one rename (podvm_core/atomic.py): a
reader sees the old file or the new one, never a part. It happens once per half a cap
of output, so keeping the log costs at most about three writes per byte written.

QEMU can write the directory the log is in, and plant any name there: the log is
reached through descriptors alone (shim/vm/workdir.py), each new file made under a name
nobody can guess and renamed over the log's, the newest half read back from the file
this writer holds, so no name QEMU plants is followed or opened."""
from __future__ import annotations

import os

from podvm_core.atomic import replace_at

from . import workdir


class CappedLog:
    """`path` holding at most `max_bytes` of the newest output; `write()` adds output."""

    def __init__(self, path: str, max_bytes: int) -> None:
        if max_bytes < 2:
            raise ValueError(f"a console log needs room for at least 2 bytes, got {max_bytes}")
        self.path = path
        self.max_bytes = max_bytes
        self._name = os.path.basename(path)
        self._dir, self._fd = workdir.create(path)  # a new log per launch, as QEMU's was
        self._size = 0

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

    def close_file(self) -> None:
        """The log's descriptors closed (the file stays, for the messages that quote it)."""
        for fd in (self._fd, self._dir):
            if fd >= 0:
                os.close(fd)
        self._fd = self._dir = -1
