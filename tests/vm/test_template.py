"""Templates (shim/vm/template/template.py): which VMs share one (the key), what is kept
and pruned in template_path, and, on a real QEMU under TCG, a template made, restored
twice and resumed, and a state that does not fit the VM refused as RestoreFailed."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import pathlib
import re
import subprocess
import time

import psutil
import pytest

from shim.vm.agent import Agent
from shim.vm.hypervisor import RestoreFailed, SavedVM, VMSpec
from shim.vm import memcopy, stateload
from shim.vm.qemu.driver import QemuVM
from shim.vm.template import store as templatestore
from shim.vm.template import template as templates
from shim.network.model import TapNic
from testbed.prereqs import require_root
from testbed.vmconfig import vm_config


def files_spec(tmp_path: pathlib.Path, **changes) -> VMSpec:
    """A spec over stand-in files: the key reads only their identity."""
    for name in ("qemu", "vmlinux", "initrd", "rootfs"):
        path = tmp_path / name
        if not path.exists():
            path.write_bytes(b"\0" * 4096)
    cfg = vm_config(path=str(tmp_path / "qemu"), kernel=str(tmp_path / "vmlinux"),
                    initrd=str(tmp_path / "initrd"), image=str(tmp_path / "rootfs"),
                    template_path=str(tmp_path / "store"))
    base = VMSpec(sandbox_id="a", workdir=str(tmp_path / "a" / "vm"),
                  shared_dir=str(tmp_path / "a" / "shared"), vcpus=1, max_vcpus=2,
                  memory_mib=256, max_memory_mib=1024, hypervisor=cfg.qemu)
    return dataclasses.replace(base, **changes)


def nic(index: int, mac: str, mtu: int = 1500, fd: int = 10) -> TapNic:
    return TapNic(index=index, interface=f"eth{index}", tap=f"tap{index}", mac=mac, mtu=mtu,
                  tap_fd=fd)


def test_pods_of_one_shape_share_a_key_and_other_shapes_do_not(tmp_path) -> None:
    one = templates.of(files_spec(tmp_path, nics=(nic(0, "0a:00:00:00:00:01"),)))
    # Another pod: its own id, directories, tap and MAC.
    other = templates.of(files_spec(
        tmp_path, sandbox_id="b", workdir=str(tmp_path / "b" / "vm"),
        shared_dir=str(tmp_path / "b" / "shared"),
        nics=(nic(0, "0a:00:00:00:00:02", fd=12),)))
    assert one.key == other.key and one.directory == str(tmp_path / "store")
    differ = [
        files_spec(tmp_path, nics=(nic(0, "0a:00:00:00:00:01", mtu=9000),)),
        files_spec(tmp_path, nics=()),
        files_spec(tmp_path, nics=(nic(0, "0a:00:00:00:00:01"), nic(1, "0a:00:00:00:00:03"))),
        files_spec(tmp_path, vcpus=2, nics=(nic(0, "0a:00:00:00:00:01"),)),
        files_spec(tmp_path, memory_mib=512, nics=(nic(0, "0a:00:00:00:00:01"),)),
        files_spec(tmp_path, max_memory_mib=2048, nics=(nic(0, "0a:00:00:00:00:01"),)),
    ]
    keys = {templates.of(s).key for s in differ}
    assert len(keys) == len(differ) and one.key not in keys
    # A new guest image is a new key.
    os.utime(tmp_path / "initrd", ns=(1, 1))
    assert templates.of(files_spec(tmp_path, nics=(nic(0, "0a:00:00:00:00:01"),))).key != one.key


def test_the_blank_is_in_the_key_a_pod_s_disk_and_its_size_are_not(tmp_path) -> None:
    one = templates.of(files_spec(tmp_path, scratch_disk="/proc/self/fd/7"))
    assert templates.of(files_spec(tmp_path, scratch_disk="/proc/self/fd/9")).key == one.key
    assert re.search(r"-scratch/blank-128M-[0-9a-f]{8}\.ext4$", one.inputs["scratch"][0])
    q = files_spec(tmp_path).hypervisor
    # every disk starts as one blank and grows after the restore: no shape per size
    bigger = dataclasses.replace(q, scratch_disk_mib=4096)
    assert templates.of(files_spec(tmp_path, hypervisor=bigger)).key == one.key
    no_disk = dataclasses.replace(q, scratch_disk_mib=0)
    assert templates.of(files_spec(tmp_path, hypervisor=no_disk)).key != one.key
    os.unlink(one.inputs["scratch"][0])  # a new blank: the guest read the old one's blocks
    assert templates.of(files_spec(tmp_path)).key != one.key


@pytest.mark.parametrize("vcpus, memory, base", [
    (1, 256, (1, 256)),               # the default size: its own shape
    (2, 256 + 3 * 128, (1, 256)),     # vCPUs and whole blocks are hot-plugged after
    (2, 256 + 1024, (1, 256)),
    (1, 300, (1, 300)),               # what blocks cannot add stays in the shape
    (2, 256 + 128 + 44, (1, 300)),
    (1, 200, (1, 200)),               # smaller than the defaults: never grown down
])
def test_a_template_is_of_its_class_s_boot_size(tmp_path, vcpus, memory, base) -> None:
    q = files_spec(tmp_path).hypervisor
    shape = templates.base_of(files_spec(tmp_path, vcpus=vcpus, memory_mib=memory),
                              q.default_vcpus, q.default_memory)
    assert (shape.vcpus, shape.memory_mib) == base


def test_pods_that_differ_by_vcpus_and_whole_blocks_share_a_template(tmp_path) -> None:
    keys = {templates.of(templates.base_of(
        files_spec(tmp_path, vcpus=v, memory_mib=256 + 128 * blocks), 1, 256)).key
        for v in (1, 2) for blocks in range(6)}
    assert len(keys) == 1


def test_prune_removes_templates_of_changed_files_and_states_without_metadata(tmp_path) -> None:
    current = templates.of(files_spec(tmp_path))
    store = pathlib.Path(current.directory)
    store.mkdir()
    for key, inputs in ((current.key, current.inputs),
                        ("old", {**current.inputs, "kernel": [str(tmp_path / "vmlinux"), 1, 2, 3]}),
                        ("gone", {"qemu": [str(tmp_path / "nowhere"), 1, 2, 3]})):
        (store / f"{key}.json").write_text(json.dumps({"format": templatestore.FORMAT,
                                                        "inputs": inputs}))
        (store / f"{key}.vmstate").write_bytes(b"state")
        (store / f"{key}.vmstate.ram").write_bytes(b"memory")
    (store / "torn.vmstate").write_bytes(b"half")
    (store / "torn2.vmstate.ram").write_bytes(b"half")
    (store / "garbled.json").write_text("{")
    assert sorted(templatestore.prune(str(store))) == ["garbled", "gone", "old"]
    assert sorted(os.listdir(store)) == [f"{current.key}.json", f"{current.key}.vmstate",
                                         f"{current.key}.vmstate.ram"]
    assert current.exists()


def test_one_maker_at_a_time(tmp_path) -> None:
    t = templates.of(files_spec(tmp_path))
    first = t.lock()
    assert first is not None
    try:
        assert t.lock() is None
    finally:
        first.release()
    again = t.lock()
    assert again is not None
    again.release()


def saved_memory(memory: pathlib.Path) -> SavedVM:
    """The memory file `memory` (`<state>.ram`) as a template records it: its digests,
    and its stamp once in place."""
    return SavedVM(state=str(memory)[:-len(".ram")], state_digests=(),
                   memory_digests=tuple(stateload.digest(str(memory))),
                   memory_stamp=memcopy.file_stamp(os.stat(memory)))


async def test_a_memory_copy_keeps_holes_and_is_checked(tmp_path) -> None:
    """What the guest had freed is a hole in the template's memory and stays one in the
    pod's memfd; the copy (shim/vm/memcopy.py, a process of its own) is hashed as it
    goes and compared with the saved digest."""
    memory = tmp_path / "m.ram"
    with open(memory, "wb") as f:
        f.truncate(8 << 20)
        f.seek(1 << 20)
        f.write(b"guest" * 1000)
        f.seek(6 << 20)
        f.write(b"\x01" * 4096)
    want = saved_memory(memory)
    memfd = os.memfd_create("t")
    try:
        await stateload.copy_memory(want, os.dup(memfd), 8 << 20, None)
        assert os.pread(memfd, 5, 1 << 20) == b"guest"
        assert os.pread(memfd, 4096, 6 << 20) == b"\x01" * 4096
        assert os.fstat(memfd).st_blocks * 512 < 1 << 20  # the holes were not copied
        with pytest.raises(RestoreFailed, match="is 8388608 bytes, not 4194304"):
            await stateload.copy_memory(want, os.dup(memfd), 4 << 20, None)
        with open(memory, "r+b") as f:  # one byte of it changed since
            f.seek((1 << 20) + 2)
            f.write(b"X")
        with pytest.raises(RestoreFailed, match="changed since it was saved"):
            await stateload.copy_memory(want, os.dup(memfd), 8 << 20, None)
        with pytest.raises(RestoreFailed, match="cannot copy .*No such file"):
            await stateload.copy_memory(dataclasses.replace(want, state=str(
                tmp_path / "gone")), os.dup(memfd), 8 << 20, None)
    finally:
        os.close(memfd)


def test_a_memory_of_many_chunks_is_copied_whole_as_it_is_read_ahead(tmp_path) -> None:
    """More data than the reading thread may hold ahead of the hash, in extents that
    end mid-chunk: the memfd is the file, byte for byte, and the digest the file's."""
    memory = tmp_path / "m.ram"
    size = 64 << 20
    data = {0: os.urandom(7 * memcopy.CHUNK + 8192), 40 << 20: os.urandom(3 << 20)}
    with open(memory, "wb") as f:
        f.truncate(size)
        for offset, chunk in data.items():
            f.seek(offset)
            f.write(chunk)
    memfd = os.memfd_create("t")
    try:
        assert memcopy.copy(str(memory), size, stateload.digest(str(memory)), memfd) == ""
        for offset, chunk in data.items():
            assert os.pread(memfd, len(chunk), offset) == chunk
        assert os.pread(memfd, 1 << 20, 36 << 20) == bytes(1 << 20)
        assert "changed since it was saved" in memcopy.copy(str(memory), size, ["0" * 64],
                                                            memfd)
    finally:
        os.close(memfd)


def test_a_read_that_fails_in_the_reading_thread_fails_the_copy(tmp_path, monkeypatch) -> None:
    memory = tmp_path / "m.ram"
    memory.write_bytes(os.urandom(6 * memcopy.CHUNK))
    reads = []
    real = os.preadv

    def failing(fd, buffers, offset):
        reads.append(offset)
        if len(reads) == 3:
            raise OSError(5, "Input/output error")
        return real(fd, buffers, offset)

    monkeypatch.setattr(memcopy.os, "preadv", failing)
    memfd = os.memfd_create("t")
    try:
        with pytest.raises(OSError, match="Input/output error"):
            memcopy.copy(str(memory), 6 * memcopy.CHUNK, ["0" * 64] * 6, memfd)
    finally:
        os.close(memfd)
    assert len(reads) == 3  # the reading thread stopped at its error


async def test_a_memory_copy_started_ahead_is_the_vms_or_stopped(tmp_path, monkeypatch
                                                                 ) -> None:
    """A copy the Machine starts before the VM (shim/vm/template/restore.py, copy_ahead):
    taken, its memfd and copy are the VM's; closed untaken, its thread stops before its
    next chunk, or its process (in the pod's cgroup, which goes next) is killed, and is
    waited for, and its memfd closed."""
    memory = tmp_path / "m.ram"
    memory.write_bytes(os.urandom(1 << 20))
    saved = saved_memory(memory)
    assert saved.memory == str(memory)
    taken = stateload.MemoryCopy(saved, 1 << 20, lambda: None)
    memfd, done = taken.take()
    await done
    await taken.close()  # the VM's: nothing to do here
    assert os.pread(memfd, 1 << 20, 0) == memory.read_bytes()
    os.close(memfd)

    def copiers() -> list[psutil.Process]:
        found = []
        for child in psutil.Process().children():  # the run may have others (containerd)
            try:
                if child.status() != psutil.STATUS_ZOMBIE and \
                        any(a.endswith("memcopy.py") for a in child.cmdline()):
                    found.append(child)
            except psutil.NoSuchProcess:
                pass
        return found

    big = tmp_path / "big.ram"  # in a thread of this process: many chunks to copy
    big.write_bytes(os.urandom(64 << 20))
    writes, real_pwrite = [], os.pwrite

    def slow_pwrite(fd, data, offset):
        writes.append(offset)
        time.sleep(0.05)
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(memcopy.os, "pwrite", slow_pwrite)
    copying = stateload.MemoryCopy(SavedVM(state=str(big)[:-4], state_digests=(),
                                           memory_digests=("0" * 64,) * 32), 64 << 20,
                                   lambda: None)
    async with asyncio.timeout(10):
        while not writes:
            await asyncio.sleep(0.01)
    await copying.close()
    stopped_at = len(writes)
    assert stopped_at < 32 // 2  # of 32 chunks: it stopped, it did not run out
    assert copying.done.cancelled()
    with pytest.raises(OSError):
        os.fstat(copying.memfd)
    await asyncio.sleep(0.2)
    assert len(writes) == stopped_at  # nothing written after close() returned
    monkeypatch.undo()

    fifo = tmp_path / "stalled.ram"
    os.mkfifo(fifo)  # no regular file: a copier's, whose open waits for a writer
    stalled = stateload.MemoryCopy(dataclasses.replace(saved, state=str(fifo)[:-4]),
                                   1 << 20, lambda: None)
    async with asyncio.timeout(10):  # its exec, on a loaded machine
        while len(copiers()) != 1:
            await asyncio.sleep(0.05)
    started = time.monotonic()
    await stalled.close()
    assert time.monotonic() - started < 5
    assert copiers() == []
    assert stalled.done.cancelled()
    with pytest.raises(OSError):
        os.fstat(stalled.memfd)
    await stalled.close()  # twice: nothing to do


def test_pages_of_zeros_in_a_saved_memory_become_holes(tmp_path) -> None:
    """Pages the guest touched and left zero are neither kept, copied nor charged."""
    memory = tmp_path / "m.ram"
    with open(memory, "wb") as f:
        f.truncate(16 << 20)
        f.write(bytes(4 << 20) + b"a" * 4096 + bytes(8192) + b"b" * 10)
    assert os.stat(memory).st_blocks * 512 >= 4 << 20
    content = memory.read_bytes()
    assert memcopy.dig_holes(str(memory)) == (4 << 20) + 8192
    assert memory.read_bytes() == content  # the same bytes, fewer blocks
    assert os.stat(memory).st_blocks * 512 <= 2 * 4096


def test_a_state_is_read_whole_and_checked(tmp_path) -> None:
    state = tmp_path / "s.vmstate"
    state.write_bytes(b"QEVM" + os.urandom(300_000))
    want = stateload.digest(str(state))
    assert stateload.read_state(str(state), want) == state.read_bytes()
    state.write_bytes(state.read_bytes()[:-1])  # a torn copy
    with pytest.raises(RestoreFailed, match="changed since it was saved"):
        stateload.read_state(str(state), want)
    (tmp_path / "link").symlink_to(state)
    with pytest.raises(RestoreFailed, match="cannot read the template"):
        stateload.read_state(str(tmp_path / "link"), want)


def vm_spec(tmp_path: pathlib.Path, name: str, **changes) -> VMSpec:
    require_root()
    # the run's scratch blank, whose identity is in the key: one for the made template
    # and the pods of every test that restore it
    cfg = vm_config(template_path=str(tmp_path / "store"),
                    scratch_path=vm_config().qemu.scratch_path)
    (tmp_path / name / "shared").mkdir(parents=True, exist_ok=True)
    spec = VMSpec(sandbox_id=name, workdir=str(tmp_path / name / "vm"),
                  shared_dir=str(tmp_path / name / "shared"), vcpus=1, max_vcpus=2,
                  memory_mib=256, max_memory_mib=1024, hypervisor=cfg.qemu)
    return dataclasses.replace(spec, **changes)


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> templates.Template:
    """One template made on a real QEMU for the module; each test takes a copy of it."""
    tmp_path = tmp_path_factory.mktemp("made")
    spec = vm_spec(tmp_path, "maker")
    template = templates.of(spec)
    asyncio.run(template.make(spec, None))
    assert template.exists() and not os.path.exists(spec.workdir + "-template")
    assert json.loads(open(template.meta).read())["made_by"] == "maker"
    for path in (template.state, template.memory, template.meta):  # not the maker's QEMU's
        st = os.stat(path)
        assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (0, 0, 0o600), path
    return template


def copy_of(made: templates.Template, tmp_path: pathlib.Path) -> templates.Template:
    """`made`'s files in a store of the test's own, to tamper with: their holes where
    `made` has them, and nowhere else (a zero block made a hole would change the digest)."""
    store = tmp_path / "store"
    store.mkdir(mode=0o700, exist_ok=True)
    for path in (made.state, made.memory, made.meta):
        subprocess.run(["cp", "--sparse=auto", path, str(store)], check=True)
    return templates.Template(str(store), made.key, made.inputs)


async def test_made_restored_twice_and_resumed_on_a_real_qemu(tmp_path, made) -> None:
    for name in ("one", "two"):
        pod = vm_spec(tmp_path, name, template=True)
        assert templates.of(pod).key == made.key
        vm = QemuVM(pod)
        await vm.launch(restore_from=made.saved())
        try:
            agent = Agent.of_vm(vm)
            await agent.resume_restored({}, timeout=30)
            info = await agent.ping(timeout=30)
            assert info.online_cpus == 1 and info.memory_total_bytes > 128 << 20
            await agent.close()
        finally:
            await vm.stop()


async def test_a_state_that_does_not_fit_the_vm_is_restore_failed(tmp_path, made) -> None:
    vm = QemuVM(vm_spec(tmp_path, "bigger", template=True, memory_mib=512))
    # Refused before QEMU loads anything: the memory is not the VM's size.
    with pytest.raises(RestoreFailed, match="is 268435456 bytes, not 536870912") as err:
        await vm.launch(restore_from=made.saved())
    assert made.memory in str(err.value)
    assert vm.dead()


def _flip_a_byte(path: str, memory: bool) -> None:
    with open(path, "r+b") as f:
        f.seek(os.lseek(f.fileno(), 0, os.SEEK_DATA) + 100 if memory else
               os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def _symlink_to_a_twin(path: str) -> None:
    """What a swap would start with: the file moved away (still the same bytes, so its
    digest holds) and a symlink to it left in its place."""
    twin = f"{path}.twin"
    os.rename(path, twin)
    os.symlink(twin, path)


def _replaced_by_a_larger_one(path: str) -> None:
    """A file of the same name with the same start and more after it (what a torn or
    doctored copy can leave)."""
    with open(path, "ab") as f:
        f.write(b"\0" * 4096)


@pytest.mark.parametrize("attack, which, says", [
    (_flip_a_byte, "state", "changed since it was saved"),
    (_flip_a_byte, "memory", "changed since it was saved"),
    (_symlink_to_a_twin, "state", "Too many levels of symbolic links"),
    (_symlink_to_a_twin, "memory", "Too many levels of symbolic links"),
    (_replaced_by_a_larger_one, "state", "changed since it was saved"),
    (os.unlink, "state", "cannot read the template"),
])
async def test_a_template_changed_since_it_was_saved_is_never_loaded(
        tmp_path, made, attack, which, says) -> None:
    """A byte changed, a file swapped for a symlink, grown, or gone: RestoreFailed before
    QEMU reads the state or runs the memory (the pod then boots and the template is
    discarded), and nothing is left running."""
    template = copy_of(made, tmp_path)
    path = template.state if which == "state" else template.memory
    if attack is _flip_a_byte:
        attack(path, which == "memory")
    else:
        attack(path)
    vm = QemuVM(vm_spec(tmp_path, "pod", template=True))
    before = _live_children()
    with pytest.raises(RestoreFailed, match=says) as err:
        await vm.launch(restore_from=template.saved())
    assert path in str(err.value)
    assert vm.dead()
    assert _live_children() - before == set()


def _live_children() -> set[int]:
    live = set()
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                live.add(child.pid)
        except psutil.NoSuchProcess:
            pass  # gone between listing and asking: not live
    return live
