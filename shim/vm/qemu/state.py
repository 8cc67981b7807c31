"""A QEMU VM's state saved to a file and loaded back (shim/vm/template/template.py): QEMU's
migration stream over a descriptor passed on QMP, without memory. The guest's RAM is
shared (virtiofsd maps it), and shared RAM is what x-ignore-shared leaves out: a
template's RAM is the file its VM ran on (hypervisor.memory_file beside the state), and a
restored VM runs on a copy of it, a memfd the shim fills while QEMU starts (from before
then where the template was known earlier: stateload.MemoryCopy). Both files are
checked against their digests as they are read (shim/vm/stateload.py). The root image's
memory is not saved either: every VM maps the same file."""
from __future__ import annotations

import asyncio
import os
from typing import Awaitable, Callable

from qemu.qmp import ExecuteError, QMPClient

from .. import stateload
from ..hypervisor import HypervisorError, MemoryAhead, RestoreFailed, SavedVM, VMSpec
from .query import Execute

# Both ends of a save: shared memory (the guest's RAM, the root image) is not in the state.
SAVE_CAPS = [{"capability": "x-ignore-shared", "state": True}]

async def load(qmp: QMPClient, execute: Execute, saved: SavedVM,
               memory: Awaitable[object]) -> None:
    """The saved state into the VM paused with `-incoming defer`, once it is read whole
    and found unchanged (shim/vm/stateload.py) and `memory`, the guest's RAM being copied
    meanwhile, is there (the devices' state refers to it), through a pipe QEMU gets over
    QMP. What needs no RAM (the state's read, the migration's settings) is done first,
    while the copy, the longer, goes on."""
    data = await asyncio.to_thread(stateload.read_state, saved.state, saved.state_digests)
    await qmp.execute("migrate-set-capabilities", {"capabilities": SAVE_CAPS})
    # No self-announcement once loaded: QEMU would send reverse-ARP frames from the
    # template's MACs on every restored pod's network before Resume gives the NICs the
    # pod's own; the guest's own traffic announces those.
    await qmp.execute("migrate-set-parameters", {"announce-rounds": 0})
    await memory

    async def send(fd: int) -> None:
        qmp.send_fd_scm(fd)
        await qmp.execute("getfd", {"fdname": stateload.FD_NAME})
        await qmp.execute("migrate-incoming", {"uri": f"fd:{stateload.FD_NAME}"})

    await stateload.load(data, send, lambda: migration_done(execute, "loading"))


def open_memory(spec: VMSpec, restore_from: SavedVM | None,
                preexec: Callable[[], None] | None,
                ahead: MemoryAhead | None = None
                ) -> tuple[int, asyncio.Future[str] | None]:
    """The descriptor of the file the guest's RAM will be (-1: a memfd of QEMU's own),
    and the copy under way into it (in the pod's sandbox cgroup, `preexec`): a memfd
    filled from the template's memory (and checked) for a restore, `ahead` where the
    caller started it already; the template's memory file, made new (never an existing
    file or a symlink's target), for a VM to be saved."""
    if restore_from is not None:
        if ahead is None:
            ahead = stateload.MemoryCopy(restore_from, spec.memory_mib << 20,
                                         lambda: preexec)
        return ahead.take()
    if spec.memory_path:
        return os.open(spec.memory_path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                       | os.O_CLOEXEC, 0o600), None
    return -1, None


async def save(send_fd: Callable[[int], None], execute: Execute, path: str) -> None:
    """Stop the guest and write its state to `path` (created; QEMU's migration stream,
    without the root image: it is mapped shared, and every VM maps the same file). The
    file's pages are dropped from the host's page cache once it is on disk. `send_fd`
    passes a descriptor to QEMU over QMP."""
    await execute("stop")
    await execute("migrate-set-capabilities", {"capabilities": SAVE_CAPS})
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)  # made new: never an existing file, nor a symlink's target
    try:
        send_fd(fd)
        await execute("getfd", {"fdname": "template"})
        try:
            await execute("migrate", {"uri": "fd:template"})
        except ExecuteError as exc:
            raise HypervisorError(f"QEMU refused to save the VM: {exc}") from None
        await migration_done(execute, "saving")
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


async def migration_done(execute: Execute, doing: str) -> None:
    """Until QEMU says the migration `doing` ("loading", "saving") completed; RestoreFailed
    (loading) or HypervisorError (saving) when it failed."""
    while True:
        state = await execute("query-migrate")
        status = state.get("status")  # type: ignore[union-attr]
        if status == "completed":
            return
        if status in ("failed", "cancelled"):
            raise (RestoreFailed if doing == "loading" else HypervisorError)(
                f"QEMU failed {doing} the VM's state: "
                f"{state.get('error-desc', status)}")  # type: ignore[union-attr]
        await asyncio.sleep(0.005)
