"""A template's memory copied into the memfd a restored VM runs on, and checked in the
same pass, so that the pages it writes are charged to the pod: by a thread of the shim
where the shim is in the pod's sandbox cgroup (its place by default), else by this file
run as a process of its own (`python -I -S`, standard library only: it imports nothing
of podvm) started in that cgroup (shim/vm/stateload.py, copy_memory). What it reads is
never charged to the pod: a template the node keeps in its page cache (warm: its pages
charged to the templates' cache cgroup, shim/vm/template/cache.py) is read from there,
and a template that is not is read past the page cache (O_DIRECT, where the file system
allows it), so nothing is charged to the first pod that read it either.

A file's digests (shim/vm/stateload.py records and checks them) are the SHA-256 of each
CHUNK of it: over each piece of a data extent within the chunk, its offset and length (8
bytes each, little-endian) then its bytes. Holes cost nothing to hash or copy, and a hole
made data, or the other way, is a change. A chunk read from a warm template in the page
cache is not hashed again (copy).

usage: python -I -S memcopy.py PATH SIZE MEMFD INODE CTIME [RESIDENT] < DIGESTS
         exit 0: copied and unchanged; 1: not (what went wrong is on stderr).
       python -I -S memcopy.py --warm PATH < DIGESTS
         PATH's data read into the page cache, charged to this process's cgroup, and
         checked (exit 1: changed, and nothing of it left there).
       DIGESTS: the chunks' digests, separated by commas."""
from __future__ import annotations

# What a copier's start imports is on a restore's longest step: not typing (7 ms here),
# ctypes (4 ms: only a template's making punches holes) nor threading and queue (5 ms):
# the reading thread is _thread's (threading's own base) and its queues are
# queue.SimpleQueue's C class (_queue), which queue only imports.
import _thread
import errno
import hashlib
import mmap
import os
import struct
import sys
from _queue import SimpleQueue

CHUNK = 2 << 20
BUFFERS = 4  # read ahead: 8 MiB, for the copier's short life
ALIGN = 4096  # O_DIRECT's unit, and a page: a multiple of every logical block size in use
ZERO_PAGE = bytes(ALIGN)
FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC


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


class Digests:
    """The SHA-256 of each CHUNK of a file, over its pieces as _reads gives them (each
    piece's header, then its bytes); "" for a chunk without data. `checked(chunk)` False:
    the chunk is not hashed, only seen (SEEN)."""

    def __init__(self, size: int, checked=lambda chunk: True) -> None:
        self.got = [""] * -(-size // CHUNK)
        self._checked = checked
        self._at = -1
        self._h = None

    def piece(self, header: bytes) -> None:
        chunk = struct.unpack_from("<Q", header)[0] // CHUNK
        if chunk != self._at:
            self._end()
            self._at = chunk
            self._h = hashlib.sha256() if self._checked(chunk) else None
            self.got[chunk] = SEEN
        if self._h is not None:
            self._h.update(header)

    def data(self, chunk) -> None:
        if self._h is not None:
            self._h.update(chunk)

    def result(self) -> list[str]:
        self._end()
        return self.got

    def _end(self) -> None:
        if self._h is not None:
            self.got[self._at] = self._h.hexdigest()
            self._h = None


SEEN = "="
"""Digests' mark of a chunk with data that was not hashed."""


def pieces(fd: int, digests: Digests | None, buffer: memoryview):
    """(offset, bytes read) of every piece's reads, read into `buffer` (as long as CHUNK)
    and hashed into `digests` as they go (None: not hashed)."""
    for offset, chunk in _reads(fd, lambda: buffer,
                                digests.piece if digests is not None else _ignore):
        if digests is not None:
            digests.data(chunk)
        yield offset, chunk


def file_digests(fd: int) -> list[str]:
    """The digests of the file open as `fd`, read whole (Digests)."""
    digests = Digests(os.fstat(fd).st_size)
    for _ in pieces(fd, digests, memoryview(mmap.mmap(-1, CHUNK))):
        pass
    return digests.result()


def _ignore(header: bytes) -> None:
    pass


def _reads(fd: int, take, piece, read_from=None):
    """(offset, bytes read) of every piece of the file, each read into the buffer take()
    gives (as long as CHUNK), from the descriptor read_from(offset) gives (else `fd`'s);
    piece() is given each piece's header first. A piece is the part of a data extent
    within one CHUNK of the file; its header is its offset and length (8 bytes each,
    little-endian)."""
    for offset, length in extents(fd):
        at, end = offset, offset + length
        while at < end:
            stop = min(end, at - at % CHUNK + CHUNK)
            piece(struct.pack("<QQ", at, stop - at))
            while at < stop:
                buffer = take()
                # O_DIRECT reads whole blocks: the file's last one may go past its end.
                want = min(CHUNK - at % CHUNK, -(-(stop - at) // ALIGN) * ALIGN)
                got = min(os.preadv(fd if read_from is None else read_from(at),
                                    [buffer[:want]], at), stop - at)
                if got <= 0:
                    raise OSError(errno.EIO, f"ended at {at}, not {end}")
                yield at, buffer[:got]
                at += got


def read_ahead(fd: int, digests: Digests, read_from=None):
    """_reads' chunks (each from read_from(offset)'s descriptor where given), hashed into
    `digests`, read by a thread of its own into BUFFERS buffers in turn: the next are
    read from the disk while the caller copies this one (the disk's reads take about as
    long as the hash and the copy together). A chunk is the caller's until it asks for
    the next. However the caller stops, the reading thread has ended (no read of `fd`
    is under way) once the generator has."""
    free: SimpleQueue = SimpleQueue()
    full: SimpleQueue = SimpleQueue()
    for _ in range(BUFFERS):
        free.put(memoryview(mmap.mmap(-1, CHUNK)))  # page-aligned, as O_DIRECT wants

    def take() -> memoryview:
        buffer = free.get()
        if buffer is None:  # the caller stopped
            raise _Stopped
        return buffer

    def read() -> None:
        try:
            for offset, chunk in _reads(fd, take, full.put, read_from):
                full.put((offset, chunk))
            full.put(None)
        except BaseException as exc:  # the caller's to raise
            full.put(exc)

    _thread.start_new_thread(read, ())
    ended = False
    try:
        while (item := full.get()) is not None:
            if isinstance(item, BaseException):
                ended = True
                raise item
            if isinstance(item, bytes):  # a piece's header
                digests.piece(item)
                continue
            offset, chunk = item
            digests.data(chunk)
            yield offset, chunk
            free.put(memoryview(chunk.obj))  # the whole buffer again
        ended = True
    finally:
        if not ended:  # stopped early: the thread told to stop, and waited for
            free.put(None)
            while (item := full.get()) is not None and not isinstance(item, BaseException):
                pass


class _Stopped(Exception):
    """The reading thread's end when its caller stopped first."""


def dig_holes(path: str) -> int:
    """Every page of zeros in the file at `path` made a hole; bytes freed. A saved
    guest's memory holds many (pages touched, then cleared or never written): as holes
    they are neither kept on disk, nor copied, nor charged to a restored pod."""
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    freed = 0
    try:
        view = memoryview(mmap.mmap(-1, CHUNK))
        for offset, chunk in pieces(fd, None, view):
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
    import ctypes  # a template's making only: not in a restore's copier (see the top)

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                      ctypes.c_long(offset), ctypes.c_long(length)):
        raise OSError(ctypes.get_errno(), "fallocate(PUNCH_HOLE)")


def open_direct(path: str) -> int:
    """`path` for reading past the page cache where the file system allows it (reads
    then go into page-aligned buffers)."""
    return _open_direct(path)[0]


def _open_direct(path: str) -> tuple[int, bool]:
    """open_direct's descriptor, and whether it reads past the page cache."""
    try:
        return os.open(path, READ_FLAGS | os.O_DIRECT), True
    except OSError as exc:
        if exc.errno != errno.EINVAL:  # EINVAL: no O_DIRECT here (tmpfs)
            raise
        return os.open(path, READ_FLAGS), False


def copy(path: str, size: int, saved: list[str] | tuple[str, ...], memfd: int,
         resident: str = "", stamp: tuple[int, int] = (0, 0), stopped=lambda: False) -> str:
    """`path` into `memfd`; "" when done and each chunk still has its `saved` digest,
    else what is wrong. `resident`: a character for each CHUNK of the file, "1" where the
    shim found all its data in the host's page cache: read from there, and left there
    (charged to whoever brought it in); the rest is read past the page cache where the
    file system allows it, else dropped from it once read (it would be charged to the
    pod). A chunk read from the page cache is not hashed again while the file is the one
    its template recorded when it was saved, unchanged since (`stamp`: its inode and
    change time): what the page cache holds of it came from the disk through a warm,
    which checked it (warm). Every other chunk is hashed. stopped() is asked before each
    chunk is written: True ends the copy (ECANCELED)."""
    fd, direct = _open_direct(path)
    cache = fd
    try:
        st = os.fstat(fd)
        if st.st_size != size:
            return f"{path} is {st.st_size} bytes, not {size}"
        os.ftruncate(memfd, size)
        trusted = False  # the chunks read from the page cache taken as checked
        if "1" in resident:
            cache = os.open(path, READ_FLAGS)
            trusted = file_stamp(os.fstat(cache)) == tuple(stamp)

        def cached(chunk: int) -> bool:
            return resident[chunk:chunk + 1] == "1"

        digests = Digests(size, lambda chunk: not (trusted and cached(chunk)))
        chunks = read_ahead(fd, digests, lambda at: cache if cached(at // CHUNK) else fd)
        try:
            for offset, chunk in chunks:
                if stopped():
                    raise OSError(errno.ECANCELED, "stopped")
                os.pwrite(memfd, chunk, offset)
        finally:
            chunks.close()  # its reading thread ended: the descriptors can go
        if trusted and file_stamp(os.fstat(cache)) != tuple(stamp):
            return f"{path} changed while it was copied"
        return changed(path, digests.result(), saved)
    finally:
        if not direct:  # what this copy read into the page cache, out again
            for block in range(-(-os.fstat(fd).st_size // CHUNK)):
                if resident[block:block + 1] != "1":
                    os.posix_fadvise(fd, block * CHUNK, CHUNK, os.POSIX_FADV_DONTNEED)
        if cache != fd:
            os.close(cache)
        os.close(fd)


def file_stamp(st: os.stat_result) -> tuple[int, int]:
    """What tells a file from itself changed: its inode and change time (ns), which
    every write, truncation or new link changes, and no one but root can set back."""
    return st.st_ino, st.st_ctime_ns


def warm(path: str, saved: list[str] | tuple[str, ...]) -> str:
    """`path`'s data read into the host's page cache (charged to the caller's cgroup),
    each chunk checked against its `saved` digest; its holes are not read, so they take
    no page there. "" when it is unchanged; else what changed, and nothing of it is
    left in the page cache (a copy would take what is there as checked)."""
    fd = os.open(path, READ_FLAGS)
    try:
        wrong = changed(path, file_digests(fd), saved)
        if wrong:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return wrong
    finally:
        os.close(fd)


def changed(path: str, got: list[str], saved: list[str] | tuple[str, ...]) -> str:
    """What to say where the chunks' digests `got` (Digests.result) are not those `path`
    was saved with; "" where they are (a chunk seen and not hashed had data then)."""
    if len(got) != len(saved):
        return f"{path} changed since it was saved ({len(got)} chunks, not {len(saved)})"
    for chunk, (now, then) in enumerate(zip(got, saved)):
        if now != then and not (now == SEEN and then):
            return (f"{path} changed since it was saved (chunk {chunk}: sha256 "
                    f"{now[:16] or 'none'}..., saved as {then[:16] or 'none'}...)")
    return ""


def main(argv: list[str]) -> int:
    saved = sys.stdin.read().split(",")
    if argv[0] == "--warm":
        doing, path = "warm", argv[1]
    else:
        doing, path = "copy", argv[0]
    try:
        if doing == "warm":
            wrong = warm(path, saved)
        else:
            _, size, memfd, inode, ctime, *resident = argv
            wrong = copy(path, int(size), saved, int(memfd), "".join(resident),
                         (int(inode), int(ctime)))
    except OSError as exc:
        wrong = f"cannot {doing} {path}: {exc.strerror or exc}"
    if wrong:
        print(wrong, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
