"""The templates' page cache (shim/vm/template/cache.py): a template's memory warmed is
charged to the cache's cgroup; a pod's copy reads it from there without being charged
for it, and reads one that is not warm past the page cache, leaving nothing there; the
copy is charged to the pod for its memfd alone, made by a copier process started in
the pod's cgroup (a shim outside it) or by a thread of a shim inside it. On this host's
cgroup v1 memory hierarchy, with real processes in real cgroups (the charge of a page
goes to the cgroup of the process that brought it in: the same rule on v2)."""
from __future__ import annotations

import asyncio
import json
import os
import pathlib
import subprocess
import sys
import uuid

import pytest

from cgroups import CgroupLimits, SandboxCgroup, SandboxLayout
from shim.vm import memcopy, stateload
from shim.vm.hypervisor import SavedVM
from shim.vm.template import cache
from testbed import cgroupdirs
from testbed.containerd import REPO_ROOT
from testbed.prereqs import require_root
from testbed.vmconfig import vm_config

MIB = 1 << 20
DATA = {0: 24 * MIB, 64 * MIB: 16 * MIB}
"""The memory file's data extents (offset: length); the rest of its 128 MiB are holes."""
SIZE = 128 * MIB
SLACK = 8 * MIB
"""Beyond the memfd's pages: the kernel's per-CPU charge batches and the odd page the
copier's own start brings in. Charging the data's page cache too would add 40 MiB."""


def memory_charged(cgroup: str) -> int:
    return int(pathlib.Path(f"/sys/fs/cgroup/memory{cgroup}/memory.usage_in_bytes")
               .read_text())


@pytest.fixture
def cgroups_here():
    """A private template_cgroup and pod cgroup parent, removed with all below them."""
    require_root()
    if not os.path.isdir("/sys/fs/cgroup/memory"):
        pytest.fail("this test reads the cgroup v1 memory hierarchy (this host's)")
    tag = uuid.uuid4().hex[:8]
    made: list[SandboxCgroup] = []
    yield f"/podvm-test-tcache-{tag}", f"/podvm-test-tpods-{tag}", made
    for cgroup in made:
        cgroup.destroy()
    for top in (f"/podvm-test-tcache-{tag}", f"/podvm-test-tpods-{tag}"):
        cgroupdirs.remove_cgroup(top)


def memory_file(directory: pathlib.Path) -> tuple[str, dict[int, bytes]]:
    """A template's memory file on disk and not in the page cache, and its data."""
    path, data = directory / "t.vmstate.ram", {o: os.urandom(n) for o, n in DATA.items()}
    with open(path, "wb") as f:
        f.truncate(SIZE)
        for offset, chunk in data.items():
            f.seek(offset)
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return str(path), data


def saved(path: str) -> SavedVM:
    """The memory at `path` as a template records it once it is in place: its digests
    and its stamp (what the page cache holds of it is then taken as checked)."""
    return SavedVM(path[:-len(".ram")], (), tuple(stateload.digest(path)),
                   memcopy.file_stamp(os.stat(path)))


async def copied_by_a_pod(path: str, data: dict[int, bytes], parent: str, name: str,
                          made: list, where: str) -> tuple[str, int]:
    """`path` copied as a pod's restore copies it, in a pod cgroup of its own: which of its
    chunks it read from the page cache (stateload.cached_chunks' form), and what that
    cgroup is charged for the copy (the memfd it filled held meanwhile). `where`:
    "copier", a process of its own started in the pod cgroup (a shim outside it), or
    "shim", a thread of a process in the pod cgroup (a shim placed there)."""
    pod = SandboxCgroup.create(SandboxLayout(parent, name), CgroupLimits())
    made.append(pod)
    if where == "shim":
        return await copied_inside(path, data, pod)
    memfd = os.memfd_create("t")
    try:
        chunks = await stateload.copy_memory(saved(path), os.dup(memfd), SIZE,
                                             pod.preexec())
        for offset, chunk in data.items():
            assert os.pread(memfd, len(chunk), offset) == chunk
        return chunks, memory_charged(pod.layout.sandbox)
    finally:
        os.close(memfd)


SHIM_INSIDE = """
import asyncio, json, os, pathlib, sys
from shim.vm import stateload
from shim.vm.hypervisor import SavedVM
path, size, charge, digests, inode, ctime = sys.argv[1:]
saved = SavedVM(path[:-len(".ram")], (), tuple(digests.split(",")), (int(inode), int(ctime)))
memfd = os.memfd_create("t")
before = int(pathlib.Path(charge).read_text())
chunks = asyncio.run(stateload.copy_memory(saved, os.dup(memfd), int(size), None))
print(json.dumps({"chunks": chunks, "before": before, "memfd": memfd}), flush=True)
sys.stdin.readline()  # the memfd held until the test has read the charge
"""
"""A process in the pod cgroup copying in a thread of its own (preexec None), as a shim
placed in its sandbox cgroup does: its charge read before the copy, after its imports."""


async def copied_inside(path: str, data: dict[int, bytes], pod: SandboxCgroup
                        ) -> tuple[str, int]:
    charge = f"/sys/fs/cgroup/memory{pod.layout.sandbox}/memory.usage_in_bytes"
    memory = saved(path)
    shim = pod.spawn([sys.executable, "-c", SHIM_INSIDE, path, str(SIZE), charge,
                      ",".join(memory.memory_digests), *map(str, memory.memory_stamp)],
                     cwd=REPO_ROOT,
                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        said = json.loads(await asyncio.to_thread(shim.stdout.readline))
        with open(f"/proc/{shim.pid}/fd/{said['memfd']}", "rb") as memfd:
            for offset, chunk in data.items():
                assert os.pread(memfd.fileno(), len(chunk), offset) == chunk
        return said["chunks"], memory_charged(pod.layout.sandbox) - said["before"]
    finally:
        shim.stdin.close()
        assert shim.wait(timeout=30) == 0


WARM_TRIES = 5

PIN = """
import ctypes, json, mmap, os, sys
from shim.vm import memcopy, stateload
path = sys.argv[1]
before = stateload.cached_chunks(path)  # what the warm left, before this reads any
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
fd = os.open(path, os.O_RDONLY)
size = os.fstat(fd).st_size
base = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
for offset, length in memcopy.extents(fd):  # the data only: a hole locked would be read
    if libc.mlock(ctypes.c_void_p(base + offset), ctypes.c_size_t(length)):
        raise OSError(ctypes.get_errno(), "mlock")
print(json.dumps(before), flush=True)
for line in sys.stdin:  # "OFFSET LENGTH": unlocked and unmapped, so it can be evicted
    offset, length = map(int, line.split())
    if libc.munmap(ctypes.c_void_p(base + offset), ctypes.c_size_t(length)):
        raise OSError(ctypes.get_errno(), "munmap")
    print("released", flush=True)
"""
"""Locks a file's data in the page cache (what a page's lock reads in is charged to this
process's cgroup, as a warm's read is), after saying which of its chunks were cached."""


class Pinned:
    """PIN run in `cgroup` over `path`; `before`: its chunks cached before it locked."""

    def __init__(self, path: str, cgroup: SandboxCgroup) -> None:
        self.proc = cgroup.spawn([sys.executable, "-c", PIN, path], cwd=REPO_ROOT,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        assert line, f"the pinning process ended: {self.proc.wait()}"
        self.before: str = json.loads(line)

    def release(self, offset: int, length: int) -> None:
        self.proc.stdin.write(f"{offset} {length}\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline() == "released\n"

    def close(self) -> None:
        self.proc.stdin.close()
        assert self.proc.wait(timeout=30) == 0


async def warmed_and_pinned(q, path: str) -> "Pinned":
    """`path` warmed by cache.warm, then its data locked in the page cache by a process
    in the cache's cgroup once that process found all of it cached. This host's DAMON
    pages out page cache it finds in physical regions idle for a minute, fresh pages
    too, seconds after they were read: nothing below could otherwise say what the copy
    did and what the host did. A warm that leaves anything uncached is tried again, so
    a warm that reads nothing fails every try."""
    cache_cgroup = cache.layout(q).sandbox
    seen = []
    for _ in range(WARM_TRIES):
        assert await cache.warm(q, path, stateload.digest(path))
        assert os.listdir(f"/sys/fs/cgroup/memory{cache_cgroup}") and \
            pathlib.Path(f"/sys/fs/cgroup/memory{cache_cgroup}/memory.limit_in_bytes"
                         ).read_text().strip() == str(256 * MIB)
        assert pathlib.Path(f"/sys/fs/cgroup/memory{cache_cgroup}/cgroup.procs"
                            ).read_text() == "", "the warmer has exited"
        pin = Pinned(path, SandboxCgroup.create(cache.layout(q), None))
        if "0" not in pin.before:
            assert memory_charged(cache_cgroup) >= sum(DATA.values())
            return pin
        seen.append(pin.before)
        pin.close()
    pytest.fail(f"warmed {WARM_TRIES} times, never all of it cached: {seen}")


@pytest.mark.parametrize("where", ["copier", "shim"])
async def test_a_warm_template_is_copied_from_ram_and_charged_to_the_cache_not_the_pod(
        tmp_path, cgroups_here, where) -> None:
    template_cgroup, pods, made = cgroups_here
    q = vm_config(template_cgroup=template_cgroup, template_max_mib=256).qemu
    path, content = memory_file(tmp_path)
    data = sum(DATA.values())
    assert not stateload.resident(path)

    # Not warm: read past the page cache; the pod pays for its memfd only, and nothing
    # of the file is left cached (charged to it).
    chunks, charged = await copied_by_a_pod(path, content, pods, "cold", made, where)
    data_chunks = "".join("0" if any(o <= c * memcopy.CHUNK < o + n for o, n in DATA.items())
                          else "-" for c in range(SIZE // memcopy.CHUNK))
    assert chunks == data_chunks, "none of it from the page cache, holes not read"
    assert data <= charged < data + SLACK, charged / MIB
    assert not stateload.resident(path)

    pin = await warmed_and_pinned(q, path)
    try:
        # Warm: read from the page cache, not charged to the pod.
        chunks, charged = await copied_by_a_pod(path, content, pods, "warm", made, where)
        assert chunks == data_chunks.replace("0", "1"), "all of it from the page cache"
        assert data <= charged < data + SLACK, charged / MIB

        assert await cache.warm(q, path, stateload.digest(path)), \
            "warm already: nothing to read"

        # Partly evicted (the host reclaims clean page cache as it needs): the chunks
        # still cached are read there, the rest past the page cache, and neither is
        # charged.
        pin.release(8 * MIB, MIB)  # half of chunk 4, unlocked and out of the page cache
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 8 * MIB, MIB, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        partly = stateload.cached_chunks(path)
        assert partly == data_chunks[:4].replace("0", "1") + "0" + \
            data_chunks[5:].replace("0", "1"), partly
        chunks, charged = await copied_by_a_pod(path, content, pods, "partly", made, where)
        assert chunks == partly
        assert data <= charged < data + SLACK, charged / MIB
        assert stateload.cached_chunks(path) == partly, "nothing read into the page cache"
    finally:
        pin.close()


async def test_a_template_that_cannot_be_warmed_says_so_and_stays_cold(
        tmp_path, cgroups_here, caplog) -> None:
    template_cgroup, _, _ = cgroups_here
    q = vm_config(template_cgroup=template_cgroup).qemu
    assert not await cache.warm(q, str(tmp_path / "gone.ram"), ())
    assert "not kept in the page cache" in caplog.text and "No such file" in caplog.text
    fifo = tmp_path / "fifo.ram"
    os.mkfifo(fifo)  # no O_NOFOLLOW trouble, but no data extents to seek: refused
    assert not stateload.resident(str(fifo))
