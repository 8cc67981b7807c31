"""A pod's scratch disk grown to its plan's size after boot (shim/vm/scratchgrow.py): the
device first, then the guest's file system; a guest that cannot grow it is said to be
older than the shim; the Machine's VMScratch records the disk's inode before growing it,
shows it in the pod's log directory and hides it as the VM stops. The real thing through
a guest: tests/e2e/test_scratch_size.py."""
from __future__ import annotations

import asyncio
import os
import types

import pytest

from podvm_core.ttrpc import Code, TtrpcError
from shim.api.errors import code_of
from shim.resources.storage import BLANK_MIB
from shim.host import podlogdisk
from shim.vm import scratchgrow
from shim.vm.hypervisor import StaleGuest

MIB = 1 << 20


class Steps:
    def __init__(self, guest_error: TtrpcError | None = None, disk_fd: int = -1) -> None:
        self.done: list[tuple[str, int]] = []
        self.guest_error = guest_error
        self.pid = os.getpid()
        self.spec = types.SimpleNamespace(sandbox_id="sb",
                                          scratch_disk=f"/proc/self/fd/{disk_fd}")

    async def resize_scratch(self, size: int) -> None:
        self.done.append(("device", size))

    async def grow_scratch(self, size: int) -> int:
        if self.guest_error is not None:
            raise self.guest_error
        self.done.append(("guest", size))
        return size


def test_the_device_grows_then_the_guest_s_file_system() -> None:
    steps = Steps()
    asyncio.run(scratchgrow.grow(steps, steps, 220))  # type: ignore[arg-type]
    assert steps.done == [("device", 220 * MIB), ("guest", 220 * MIB)]
    asyncio.run(scratchgrow.grow(steps, steps, BLANK_MIB))  # type: ignore[arg-type]
    assert len(steps.done) == 2  # the blank's size already: nothing to do


def test_an_older_guest_is_named_and_other_errors_pass() -> None:
    old = Steps(TtrpcError(Code.UNIMPLEMENTED, "method GrowScratch"))
    with pytest.raises(StaleGuest) as said:
        asyncio.run(scratchgrow.grow(old, old, 220))  # type: ignore[arg-type]
    assert code_of(said.value) == Code.FAILED_PRECONDITION  # fix the node, not the pod
    assert "older than the shim" in str(said.value) and "220 MiB" in str(said.value)
    broken = Steps(TtrpcError(Code.INTERNAL, "growing: EIO"))
    with pytest.raises(TtrpcError, match="EIO"):
        asyncio.run(scratchgrow.grow(broken, broken, 220))  # type: ignore[arg-type]


def test_the_machine_s_scratch_is_recorded_before_it_grows_shown_then_hidden(tmp_path):
    logs = tmp_path / "ns_pod_uid"
    logs.mkdir()
    fd = os.open(tmp_path, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
    try:
        steps = Steps(disk_fd=fd)
        recorded: list[dict] = []

        def record(**changes) -> None:
            recorded.append(changes)
            steps.done.append(("recorded", 0))

        scratch = scratchgrow.VMScratch("c" * 64, str(logs), record)
        asyncio.run(scratch.grow_and_show(steps, steps, 220))  # type: ignore[arg-type]
        assert recorded == [{"scratch_inode": os.fstat(fd).st_ino}]
        assert steps.done == [("recorded", 0), ("device", 220 * MIB), ("guest", 220 * MIB)]
        shown = logs / podlogdisk.name_for("c" * 64)
        assert os.stat(shown).st_ino == os.fstat(fd).st_ino
        scratch.hide()
        assert not shown.exists()
        scratch.hide()  # idempotent
        nowhere = scratchgrow.VMScratch("d" * 64, "", record)  # no log directory given
        asyncio.run(nowhere.grow_and_show(steps, steps, BLANK_MIB))  # type: ignore[arg-type]
        assert sorted(os.listdir(logs)) == []
        nowhere.hide()
    finally:
        os.close(fd)
