"""A template's memory checked once, not on every restore (shim/vm/memcopy.py): each
2 MiB chunk has its own digest; a chunk in the host's page cache was checked when the warm
read it in and is not hashed again while the file keeps the stamp (inode, change time)
recorded when the template was saved; every chunk read from the disk is hashed. Played
here by an attacker with root's two ways to change a template: through the file system
(the stamp changes) and on the disk under it (the stamp does not; the pages are read
from the disk again once the host dropped them)."""
from __future__ import annotations

import hashlib
import json
import os
import pathlib

import pytest

from shim.vm import memcopy, stateload
from shim.vm.hypervisor import RestoreFailed
from shim.vm.template import store
from shim.vm.template.template import Template
from testbed.loopfs import LoopFs
from testbed.prereqs import require_root

CHUNK = memcopy.CHUNK


def template_memory(path: pathlib.Path, chunks: int) -> tuple[list[str], tuple[int, int]]:
    """`chunks` chunks of random data at `path`, on disk; its digests and stamp, as a
    template records them."""
    with open(path, "wb") as f:
        f.write(os.urandom(chunks * CHUNK))
        os.fsync(f.fileno())
    return stateload.digest(str(path)), memcopy.file_stamp(os.stat(path))


def hashes_counted(monkeypatch) -> list[int]:
    """The SHA-256s memcopy starts from now on, counted."""
    made = []
    real = hashlib.sha256

    def counted(*args):
        made.append(1)
        return real(*args)

    monkeypatch.setattr(memcopy.hashlib, "sha256", counted)
    return made


def evict(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def test_a_warm_chunk_is_not_hashed_again_until_the_file_changes(tmp_path, monkeypatch
                                                                  ) -> None:
    """Warm and unchanged: the copy hashes nothing. One byte written through the file
    system (the page cache holds it: the chunk is still "in the cache"): its change
    time moved, every chunk is hashed and the copy is refused."""
    memory = tmp_path / "t.vmstate.ram"
    saved, stamp = template_memory(memory, 4)
    evict(memory)
    assert memcopy.warm(str(memory), saved) == ""
    # What the shim's mincore would say (this host's DAMON may drop a page meanwhile:
    # the copy then reads it from the disk through the page cache, unhashed, as it would)
    resident = "1111"
    made = hashes_counted(monkeypatch)
    memfd = os.memfd_create("t")
    try:
        assert memcopy.copy(str(memory), 4 * CHUNK, saved, memfd, resident, stamp) == ""
        assert made == [], "a warm chunk hashed again"
        assert os.pread(memfd, 4 * CHUNK, 0) == memory.read_bytes()

        with open(memory, "r+b") as f:  # root, through the file system
            f.seek(2 * CHUNK + 100)
            f.write(b"X")
        wrong = memcopy.copy(str(memory), 4 * CHUNK, saved, memfd, "1111", stamp)
        assert "changed since it was saved (chunk 2:" in wrong, wrong
        assert len(made) == 4, "each chunk hashed once the stamp changed"
    finally:
        os.close(memfd)


def test_a_warm_template_written_during_its_copy_is_refused(tmp_path) -> None:
    """Root writes a chunk the copy has yet to read from the page cache, unhashed: the
    stamp read again after the copy has moved."""
    memory = tmp_path / "t.vmstate.ram"
    saved, stamp = template_memory(memory, 4)
    asked = []

    def stopped() -> bool:  # before each chunk is written
        if not asked:
            with open(memory, "r+b") as f:
                f.seek(3 * CHUNK + 5)
                f.write(b"X")
        asked.append(1)
        return False

    memfd = os.memfd_create("t")
    try:
        wrong = memcopy.copy(str(memory), 4 * CHUNK, saved, memfd, "1111", stamp, stopped)
        assert wrong.endswith("changed while it was copied"), wrong
    finally:
        os.close(memfd)


def test_a_template_without_its_stamp_is_hashed_whole(tmp_path, monkeypatch) -> None:
    """A template copied or restored from a backup (another inode) and one made by a
    podvm that recorded no stamp ((0, 0)) are hashed as they are read, cached or not."""
    memory = tmp_path / "t.vmstate.ram"
    saved, stamp = template_memory(memory, 2)
    made = hashes_counted(monkeypatch)
    memfd = os.memfd_create("t")
    try:
        for other in ((0, 0), (stamp[0] + 1, stamp[1]), (stamp[0], stamp[1] - 1)):
            made.clear()
            assert memcopy.copy(str(memory), 2 * CHUNK, saved, memfd, "11", other) == ""
            assert len(made) == 2, other
    finally:
        os.close(memfd)


def test_a_chunk_with_data_where_the_template_had_a_hole_is_refused_cached_or_not(
        tmp_path) -> None:
    """A chunk seen but not hashed must have had data: one that was a hole is a change."""
    memory = tmp_path / "t.vmstate.ram"
    saved, stamp = template_memory(memory, 3)
    memfd = os.memfd_create("t")
    try:
        holed = saved[:1] + [""] + saved[2:]
        for resident in ("111", "000"):
            wrong = memcopy.copy(str(memory), 3 * CHUNK, holed, memfd, resident, stamp)
            assert "changed since it was saved (chunk 1:" in wrong, (resident, wrong)
        gone = saved[:2] + [saved[1]]  # data saved in chunk 2, a hole now: truncated
        os.truncate(memory, 2 * CHUNK)
        os.truncate(memory, 3 * CHUNK)
        wrong = memcopy.copy(str(memory), 3 * CHUNK, gone, memfd, "11-",
                             memcopy.file_stamp(os.stat(memory)))
        assert "changed since it was saved (chunk 2: sha256 none" in wrong, wrong
    finally:
        os.close(memfd)


def test_a_chunk_changed_on_the_disk_is_refused_by_the_copy_and_by_the_warm(
        tmp_path) -> None:
    """Root writes the disk under the file system: the file's stamp stays. A chunk the
    host dropped from its page cache is read from the disk again: by a restore (past the
    page cache), which hashes it and refuses; by a warm, which hashes it, refuses, and
    leaves nothing of the file in the page cache for a restore to take as checked."""
    require_root()
    with LoopFs(tmp_path / "disk.img", tmp_path / "store", 64) as disk:
        memory = disk.mountpoint / "t.vmstate.ram"
        saved, stamp = template_memory(memory, 4)
        evict(memory)
        assert memcopy.warm(str(memory), saved) == ""

        # Chunk 3 leaves the page cache; its bytes change on the disk under it.
        marker = memory.read_bytes()[3 * CHUNK + 4096:3 * CHUNK + 4096 + 64]
        fd = os.open(memory, os.O_RDONLY)
        os.posix_fadvise(fd, 3 * CHUNK, CHUNK, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        image = disk.image.read_bytes()
        at = image.find(marker)
        assert at > 0 and image.find(marker, at + 1) < 0, "the chunk's blocks on the disk"
        with open(disk.image, "r+b") as f:
            f.seek(at)
            f.write(bytes(b ^ 0xFF for b in marker[:8]))
            os.fsync(f.fileno())  # on the disk, whichever way the loop device reads it
        assert memcopy.file_stamp(os.stat(memory)) == stamp, "unchanged to the file system"

        resident = stateload.cached_chunks(str(memory))
        assert resident[3] == "0", resident  # the rest taken as checked where cached
        memfd = os.memfd_create("t")
        try:
            wrong = memcopy.copy(str(memory), 4 * CHUNK, saved, memfd, resident, stamp)
            assert "changed since it was saved (chunk 3:" in wrong, wrong
        finally:
            os.close(memfd)
        wrong = memcopy.warm(str(memory), saved)
        assert "changed since it was saved (chunk 3:" in wrong, wrong
        assert "1" not in stateload.cached_chunks(str(memory)), "left in the page cache"


def test_a_template_of_an_earlier_format_is_refused_with_its_reason(tmp_path) -> None:
    """A template an earlier podvm saved (one SHA-256 per file, no stamp) is not read
    as this one's: the restore says why, discards it, and the pod boots."""
    meta = tmp_path / "k.json"
    meta.write_text(json.dumps({"format": 4, "inputs": {},
                                "sha256": {"state": "ab" * 32, "memory": "cd" * 32}}))
    with pytest.raises(RestoreFailed, match=f"template k: format 4, not {store.FORMAT}"):
        Template(str(tmp_path), "k", {}).saved()
    meta.write_text(json.dumps({"format": store.FORMAT, "inputs": {},
                                "sha256": {"state": ["ab" * 32], "memory": []}}))
    with pytest.raises(RestoreFailed, match="no digests in .*memory_stamp"):
        Template(str(tmp_path), "k", {}).saved()
