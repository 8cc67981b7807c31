"""A saved VM's two files read back into a new VM, each checked against the digest
recorded when it was saved (a template changed since is never loaded: whoever could
change it would control the guest of every later pod of its shape):
- the state (QEMU's migration stream, a few hundred KiB) read whole by the shim and
  checked before QEMU sees a byte of it, then written into a pipe whose read end QEMU
  gets over QMP (getfd, `migrate-incoming fd:`): QEMU runs under its seccomp sandbox
  (spawn=deny) in a jail where the template is no path, so it cannot read the file;
- the guest's memory (sparse: only what the guest had in use) copied into the memfd the
  VM runs on and checked in the same pass by shim/vm/memcopy.py (what it reads from the
  host's page cache was checked once, when a warm read it in), in the pod's sandbox
  cgroup (the pages are the pod's: a thread of the shim placed there, else a process
  started there), checked before QEMU loads the state.
Neither is charged to the pod as it is read: the state is read past the host's page
cache (O_DIRECT) where the file system allows it, and so is the memory, unless the node
keeps it in its page cache (warm: shim/vm/template/cache.py), when it is read from there
(`resident`). The digest's form is memcopy.py's."""
from __future__ import annotations

import asyncio
import mmap
import os
import stat
import sys
import threading
import time
from typing import Awaitable, Callable

from .. import libc
from . import memcopy
from .hypervisor import RestoreFailed, SavedVM

FD_NAME = "template"


def digest(path: str) -> list[str]:
    """The digests of the file at `path`, one per memcopy.CHUNK ("" where it has no
    data)."""
    fd = memcopy.open_direct(path)
    try:
        return memcopy.file_digests(fd)
    finally:
        os.close(fd)


def resident(path: str) -> bool:
    """Every page of data of the file at `path` is in the host's page cache (its holes
    take none); False where it cannot be read or is no regular file."""
    chunks = cached_chunks(path)
    return bool(chunks) and "0" not in chunks


def cached_chunks(path: str) -> str:
    """For each memcopy.CHUNK of the file at `path`: "1" where every page of data in it
    is in the host's page cache, "0" where not, "-" where it has none (a hole); "" where
    the file cannot be read or is no regular file."""
    try:
        fd = os.open(path, memcopy.READ_FLAGS | os.O_NONBLOCK)  # a FIFO: no wait
    except OSError:
        return ""
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return ""
        pages, per = libc.page_cached(fd, st.st_size), memcopy.CHUNK // mmap.PAGESIZE
        chunks = ["-"] * -(-st.st_size // memcopy.CHUNK)
        for offset, length in memcopy.extents(fd):
            first, end = offset // mmap.PAGESIZE, -(-(offset + length) // mmap.PAGESIZE)
            for chunk in range(first // per, -(-end // per)):
                if chunks[chunk] != "0":
                    chunks[chunk] = "0" if b"\0" in pages[max(first, chunk * per):
                                                            min(end, (chunk + 1) * per)] else "1"
        return "".join(chunks)
    except OSError:
        return ""
    finally:
        os.close(fd)


def read_state(path: str, saved: list[str] | tuple[str, ...]) -> bytes:
    """The state in `path`, whole, if it still has the digests `saved`; RestoreFailed
    otherwise."""
    try:
        fd = memcopy.open_direct(path)
        try:
            digests = memcopy.Digests(os.fstat(fd).st_size)
            view = memoryview(mmap.mmap(-1, memcopy.CHUNK))  # page-aligned, for O_DIRECT
            data = b"".join(bytes(chunk) for _, chunk in memcopy.pieces(fd, digests, view))
        finally:
            os.close(fd)
    except OSError as exc:
        raise RestoreFailed(f"cannot read the template {path}: {exc.strerror}") from None
    wrong = memcopy.changed(path, digests.result(), saved)
    if wrong:
        raise RestoreFailed(f"the template file {wrong}")
    return data


async def copy_memory(saved: SavedVM, memfd: int, size: int,
                      preexec: Callable[[], None] | None) -> str:
    """The memory of `saved` into `memfd` (`size` bytes; a descriptor of its own, closed
    here) if each chunk still has the digest recorded at save (a chunk in the host's
    page cache is taken as checked while the file has the stamp recorded then:
    memcopy.copy), RestoreFailed otherwise (then what was copied is never run), so that
    the pages are charged to the pod's sandbox cgroup: by a thread of this process where
    `preexec` is None (this process is in that cgroup) and the memory a regular file,
    else by shim/vm/memcopy.py run as a process started there (with `preexec`), which
    can be killed where its reads wait for ever (a FIFO planted in the template's
    place). Which of its chunks were read from the host's page cache:
    cached_chunks' string."""
    path = saved.memory
    try:
        # The chunks in the page cache are read there. Asked here, not in a thread (a few
        # ms of mincore): the copy then starts in this task's first step, before the loop
        # goes on to start QEMU, whose fork holds it while QEMU's jail is made.
        chunks = cached_chunks(path)
        if preexec is None and chunks:  # else no regular file: a process can be killed
            wrong = await _copy_here(saved, memfd, size, chunks)
        else:
            wrong = await _copy_apart(saved, memfd, size, chunks, preexec)
    except OSError as exc:
        raise RestoreFailed(f"cannot copy the template's memory {path}: "
                            f"{exc.strerror}") from None
    finally:
        os.close(memfd)
    if wrong:
        raise RestoreFailed(f"the template's memory: {wrong}")
    return chunks


async def _copy_here(saved: SavedVM, memfd: int, size: int, chunks: str) -> str:
    """memcopy.copy in a thread of this process: no process to start (its fork, exec and
    interpreter took 25-35 ms of a restore's longest step). Cancelled, the copy stops
    before its next chunk and is waited for."""
    stop = threading.Event()
    copying = asyncio.ensure_future(asyncio.to_thread(
        memcopy.copy, saved.memory, size, saved.memory_digests, memfd, chunks,
        saved.memory_stamp, stop.is_set))
    try:
        return await asyncio.shield(copying)
    except asyncio.CancelledError:
        stop.set()
        await asyncio.gather(copying, return_exceptions=True)
        raise


async def _copy_apart(saved: SavedVM, memfd: int, size: int, chunks: str,
                      preexec: Callable[[], None] | None) -> str:
    """memcopy.py run as a process started with `preexec`; what it said went wrong."""
    inode, ctime = saved.memory_stamp
    copier = await asyncio.create_subprocess_exec(
        sys.executable, "-I", "-S", memcopy.__file__, saved.memory, str(size), str(memfd),
        str(inode), str(ctime), *([chunks] if "1" in chunks else []),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE, pass_fds=[memfd], preexec_fn=preexec)
    try:
        _, said = await copier.communicate(",".join(saved.memory_digests).encode())
    finally:
        if copier.returncode is None:
            copier.kill()
            await copier.wait()
    if copier.returncode:
        return said.decode(errors="replace").strip() or f"copier status {copier.returncode}"
    return ""


class MemoryCopy:
    """A saved VM's memory being copied into a memfd of its own (copy_memory), started
    before the VM that will run on it where the caller knows the template early: the
    copy is a restore's longest step. The VM take()s the memfd and the copy (then they
    are its to close and stop); close() stops one no VM took."""

    def __init__(self, saved: SavedVM, size: int,
                 preexec: Callable[[], Callable[[], None] | None],
                 made: Awaitable[object] | None = None) -> None:
        """`preexec()` gives copy_memory's `preexec` (SandboxCgroup.preexec: None where
        this process is in the sandbox cgroup), asked once `made` (the sandbox cgroup
        being made, where given) is done."""
        self.saved = saved
        self.taken = False
        self.seconds = 0.0
        """How long the copy took, from its start (once `made`) to its end."""
        self.memfd = os.memfd_create("podvm-guest-ram", os.MFD_CLOEXEC)
        self.done: asyncio.Future[str] = asyncio.ensure_future(
            self._copy(size, preexec, made))

    async def _copy(self, size: int, preexec: Callable[[], Callable[[], None] | None],
                    made: Awaitable[object] | None) -> str:
        if made is not None:
            await made
        started = time.monotonic()
        try:
            return await copy_memory(self.saved, os.dup(self.memfd), size, preexec())
        finally:
            self.seconds = time.monotonic() - started

    def take(self) -> tuple[int, asyncio.Future[str]]:
        self.taken = True
        return self.memfd, self.done

    @property
    def chunks(self) -> str:
        """Which chunks the copy read from the host's page cache (cached_chunks' string)
        once it is done; "" until then, or where it failed."""
        done = self.done
        if done.done() and not done.cancelled() and done.exception() is None:
            return done.result()
        return ""

    async def close(self) -> None:
        """The copy stopped (its process killed and waited for: it is in the pod's
        cgroup) and the memfd closed, unless a VM took them. Idempotent."""
        if not self.taken:
            self.taken = True
            self.done.cancel()
            await asyncio.gather(self.done, return_exceptions=True)
            os.close(self.memfd)


async def load(data: bytes, send_fd: Callable[[int], Awaitable[None]],
               loaded: Callable[[], Awaitable[None]]) -> None:
    """`data` into QEMU: the read end of a pipe handed over (`send_fd`: getfd named
    FD_NAME, then migrate-incoming), the bytes written from a thread until QEMU has
    them all or has stopped reading, then until `loaded`."""
    read, write = os.pipe2(os.O_CLOEXEC)
    try:
        await send_fd(read)
    except BaseException:
        os.close(write)
        raise
    finally:
        os.close(read)  # QEMU has its own copy (or none: it refused)
    writer = asyncio.ensure_future(asyncio.to_thread(_write_all, write, data))
    try:
        await loaded()
    finally:
        await asyncio.gather(writer, return_exceptions=True)


def _write_all(fd: int, data: bytes) -> None:
    """Closed when written, or when QEMU stops reading (EPIPE: its own error says why)."""
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    except BrokenPipeError:
        pass
    finally:
        os.close(fd)
