"""An uncompressed newc cpio archive, the format the kernel unpacks as initramfs.

Uncompressed boots faster than gzip under TCG (docs/design.md, Glossary: guest); entries get fixed
owners and times so the image depends on its inputs only."""
from __future__ import annotations

import os
import stat
from typing import BinaryIO

TRAILER = "TRAILER!!!"


class CpioWriter:
    def __init__(self, out: BinaryIO) -> None:
        self._out = out
        self._ino = 1
        self._seen: set[str] = set()

    def _entry(self, name: str, mode: int, data: bytes = b"", nlink: int = 1) -> None:
        name_bytes = name.encode() + b"\0"
        header = "070701" + "".join(f"{v:08X}" for v in (
            self._ino, mode, 0, 0, nlink, 0, len(data), 0, 0, 0, 0, len(name_bytes), 0))
        self._ino += 1
        self._out.write(header.encode() + name_bytes)
        self._pad()
        self._out.write(data)
        self._pad()

    def _pad(self) -> None:
        self._out.write(b"\0" * (-self._out.tell() % 4))

    def directory(self, name: str, mode: int = 0o755) -> None:
        name = name.strip("/")
        if not name or name in self._seen:
            return
        parent = os.path.dirname(name)
        if parent:
            self.directory(parent)
        self._seen.add(name)
        self._entry(name, stat.S_IFDIR | mode, nlink=2)

    def file(self, name: str, data: bytes, mode: int = 0o644) -> None:
        name = name.strip("/")
        self.directory(os.path.dirname(name))
        self._seen.add(name)
        self._entry(name, stat.S_IFREG | mode, data)

    def symlink(self, name: str, target: str) -> None:
        name = name.strip("/")
        self.directory(os.path.dirname(name))
        self._seen.add(name)
        self._entry(name, stat.S_IFLNK | 0o777, target.encode())

    def close(self) -> None:
        self._entry(TRAILER, 0)
        self._out.write(b"\0" * (-self._out.tell() % 512))
