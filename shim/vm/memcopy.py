"""A template's memory copied into the memfd a restored VM runs on, and hashed in the
same pass. The shim runs this file as a process of its own (`python -I -S`, standard
library only: it imports nothing of podvm) started in the pod's sandbox cgroup, so the
pages it writes are charged to the pod whichever cgroup the shim is in; it reads past
the host's page cache (O_DIRECT) where the file system allows it, so nothing is charged
to the first pod that read the template either.

The digest of a file (shim/vm/stateload.py records and checks it) is SHA-256 over its
data extents, each as its offset and length (8 bytes each, little-endian) then its
bytes: holes cost nothing to hash or copy, and a hole made data, or the other way, is a
change.

usage: python -I -S memcopy.py PATH SIZE SHA256 MEMFD
exit 0: copied and unchanged; 1: not (what went wrong is on stderr)."""
from __future__ import annotations

import ctypes
import errno
import hashlib
import mmap
import os
import struct
import sys

CHUNK = 4 << 20
ALIGN = 4096  # O_DIRECT's unit, and a page: a multiple of every logical block size in use
ZERO_PAGE = bytes(ALIGN)
FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 0x01, 0x02


def extents(fd: int):
    """(offset, length) of each data extent of the file, in order."""
    end, offset = os.fstat(fd).st_size, 0
    while offset < end:
        try:
            start = os.lseek(fd, offset, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # nothing but a hole to the end
                return
            raise
        stop = os.lseek(fd, start, os.SEEK_HOLE)
        yield start, stop - start
        offset = stop


def hashed(fd: int, h, buffer: memoryview):
    """(offset, bytes read) of every data extent's chunks, read into `buffer` (as long as
    CHUNK) and hashed into `h` as they go (None: not hashed)."""
    for offset, length in extents(fd):
        if h is not None:
            h.update(struct.pack("<QQ", offset, length))
        done = 0
        while done < length:
            # O_DIRECT reads whole blocks: the file's last one may go past its end.
            want = min(CHUNK, -(-(length - done) // ALIGN) * ALIGN)
            got = min(os.preadv(fd, [buffer[:want]], offset + done), length - done)
            if got <= 0:
                raise OSError(errno.EIO, f"ended at {offset + done}, not {offset + length}")
            if h is not None:
                h.update(buffer[:got])
            yield offset + done, buffer[:got]
            done += got


def dig_holes(path: str) -> int:
    """Every page of zeros in the file at `path` made a hole; bytes freed. A saved
    guest's memory holds many (pages touched, then cleared or never written): as holes
    they are neither kept on disk, nor copied, nor charged to a restored pod."""
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    freed = 0
    try:
        view = memoryview(mmap.mmap(-1, CHUNK))
        for offset, chunk in hashed(fd, None, view):
            run = -1
            for page in range(0, len(chunk) + ALIGN, ALIGN):
                zero = page < len(chunk) and chunk[page:page + ALIGN] == ZERO_PAGE
                if zero and run < 0:
                    run = page
                elif not zero and run >= 0:
                    _punch(fd, offset + run, page - run)
                    freed += page - run
                    run = -1
        return freed
    finally:
        os.close(fd)


def _punch(fd: int, offset: int, length: int) -> None:
    if _libc().fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                         ctypes.c_long(offset), ctypes.c_long(length)):
        raise OSError(ctypes.get_errno(), "fallocate(PUNCH_HOLE)")


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def open_direct(path: str) -> int:
    """`path` for reading past the page cache where the file system allows it (reads
    then go into page-aligned buffers)."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return os.open(path, flags | os.O_DIRECT)
    except OSError as exc:
        if exc.errno != errno.EINVAL:  # EINVAL: no O_DIRECT here (tmpfs)
            raise
        return os.open(path, flags)


def copy(path: str, size: int, sha256: str, memfd: int) -> str:
    """`path` into `memfd`; "" when done and unchanged, else what is wrong."""
    fd = open_direct(path)
    view = memoryview(mmap.mmap(-1, CHUNK))  # page-aligned, as O_DIRECT wants
    try:
        if os.fstat(fd).st_size != size:
            return f"{path} is {os.fstat(fd).st_size} bytes, not {size}"
        os.ftruncate(memfd, size)
        h = hashlib.sha256()
        for offset, chunk in hashed(fd, h, view):
            os.pwrite(memfd, chunk, offset)
        return changed(path, h.hexdigest(), sha256)
    finally:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def changed(path: str, got: str, saved: str) -> str:
    """What to say when `path`'s digest is not the one it was saved with; "" if it is."""
    if got == saved:
        return ""
    return (f"{path} changed since it was saved (sha256 {got[:16]}..., saved as "
            f"{saved[:16]}...)")


def main(argv: list[str]) -> int:
    path, size, sha256, memfd = argv
    try:
        wrong = copy(path, int(size), sha256, int(memfd))
    except OSError as exc:
        wrong = f"cannot copy {path}: {exc.strerror or exc}"
    if wrong:
        print(wrong, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
