"""A template's files read as memcopy.Pages (shim/vm/memcopy.py): pages resident in the
host's page cache are read from it, the others past it, and no read brings a page into
the cache (it would be charged to the reader: the restored pod, or the shim that made
the template). Files on the tests' disk, which takes O_DIRECT (ext4 here)."""
from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import pathlib

import pytest

from shim.vm import memcopy, stateload

PAGE = mmap.PAGESIZE
SIZE = 8 << 20


def resident(path: pathlib.Path) -> list[bool]:
    """Whether each page of the file is in the host's page cache (mincore(2) over a
    private mapping, which faults nothing in)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as m:
        pages = (len(m) + PAGE - 1) // PAGE
        vec = (ctypes.c_ubyte * pages)()
        anchor = ctypes.c_char.from_buffer(m)
        try:
            if libc.mincore(ctypes.addressof(anchor), len(m), vec):
                raise OSError(ctypes.get_errno(), "mincore")
        finally:
            del anchor
        return [bool(b & 1) for b in vec]


def evicted(path: pathlib.Path) -> None:
    """The file on disk and out of the page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    assert not any(resident(path))


@pytest.fixture
def memory(tmp_path) -> tuple[pathlib.Path, bytes]:
    """A template's memory of random bytes, on disk and out of the cache; its bytes."""
    path, data = tmp_path / "m.ram", os.urandom(SIZE)
    path.write_bytes(data)
    evicted(path)
    return path, data


@pytest.fixture
def reads(monkeypatch) -> list[tuple[bool, int]]:
    """(past the cache: O_DIRECT, bytes) of each read the copy makes."""
    seen: list[tuple[bool, int]] = []
    real = os.preadv

    def preadv(fd, buffers, offset):
        got = real(fd, buffers, offset)
        seen.append((bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT), got))
        return got

    monkeypatch.setattr(memcopy.os, "preadv", preadv)
    return seen


def copied(path: pathlib.Path, digest: str) -> bytes:
    memfd = os.memfd_create("t")
    try:
        assert memcopy.copy(str(path), SIZE, digest, memfd) == ""
        return os.pread(memfd, SIZE, 0)
    finally:
        os.close(memfd)


def test_a_template_out_of_the_cache_is_read_from_the_disk_and_stays_out(memory, reads):
    """What a pod restores once the kernel has evicted the template: every page read
    past the cache and none left in it (a page brought in would be charged to the pod),
    the digest taken the same way."""
    path, data = memory
    digest = stateload.digest(str(path))
    assert not any(resident(path))
    reads.clear()
    assert copied(path, digest) == data
    assert not any(resident(path))
    assert reads and all(direct for direct, _ in reads)
    assert sum(got for _, got in reads) == SIZE


def test_resident_pages_are_read_from_the_cache_the_others_past_it(memory, reads):
    """A template half in the cache (the kernel evicted the rest): the resident half
    is read from memory, the other from the disk, and the cache holds what it held."""
    path, data = memory
    digest = stateload.digest(str(path))
    with open(path, "rb") as f:  # the first half in the cache (no readahead past it)
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
        f.read(SIZE // 2)
    before = resident(path)
    assert all(before[:SIZE // 2 // PAGE]) and not any(before[SIZE // 2 // PAGE:])
    reads.clear()
    assert copied(path, digest) == data
    assert resident(path) == before
    from_disk = sum(got for direct, got in reads if direct)
    from_cache = sum(got for direct, got in reads if not direct)
    assert (from_cache, from_disk) == (SIZE // 2, SIZE // 2)


def test_scattered_resident_pages_are_read_past_the_cache_with_their_neighbours(
        memory, reads) -> None:
    """What eviction leaves: every other page resident. A chunk that is not all in the
    cache is read from the disk whole (a read a page would cost more than the disk),
    and the pages that were not resident are still not."""
    path, data = memory
    digest = stateload.digest(str(path))
    with open(path, "rb") as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
        for page in range(0, SIZE // PAGE, 2):
            os.pread(f.fileno(), 1, page * PAGE)
    before = resident(path)
    assert before == [page % 2 == 0 for page in range(SIZE // PAGE)]
    reads.clear()
    assert copied(path, digest) == data
    assert resident(path) == before
    assert all(direct for direct, _ in reads)
    assert len(reads) == SIZE // memcopy.CHUNK


def test_a_template_wholly_in_the_cache_is_never_read_from_the_disk(memory, reads):
    path, data = memory
    with open(path, "rb") as f:
        f.read()
    digest = stateload.digest(str(path))
    reads.clear()
    assert copied(path, digest) == data
    assert reads and not any(direct for direct, _ in reads)
    assert resident(path) == [True] * (SIZE // PAGE)


def test_a_changed_template_in_the_cache_is_still_refused(memory):
    """The cache serves the bytes the file has now: a change made since the digest was
    taken is found whichever way the pages are read."""
    path, data = memory
    digest = stateload.digest(str(path))
    with open(path, "r+b") as f:  # the change is in the cache, not yet on the disk
        f.seek(SIZE - 10)
        f.write(b"X")
    memfd = os.memfd_create("t")
    try:
        assert "changed since it was saved" in memcopy.copy(str(path), SIZE, digest, memfd)
    finally:
        os.close(memfd)
