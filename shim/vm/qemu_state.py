"""A QEMU VM's state saved to a file and loaded back (shim/vm/template.py): QEMU's
migration stream over a descriptor passed on QMP, without the root image's memory."""
from __future__ import annotations

import asyncio
import os
from typing import Callable

from qemu.qmp import ExecuteError, QMPClient

from . import stateload
from .hypervisor import HypervisorError, RestoreFailed
from .qemu_query import Execute

# Both ends of a save: the root image's memory (mapped shared, from a file every VM maps)
# is not part of the state.
SAVE_CAPS = [{"capability": "x-ignore-shared", "state": True}]

async def load(qmp: QMPClient, execute: Execute, path: str,
               preexec: Callable[[], None] | None) -> None:
    """The saved state in `path` into the VM paused with `-incoming defer`, through a
    pipe from a dd the shim runs (shim/vm/stateload.py); `preexec` confines the dd as
    the VM is."""
    await qmp.execute("migrate-set-capabilities", {"capabilities": SAVE_CAPS})

    async def send(fd: int) -> None:
        qmp.send_fd_scm(fd)
        await qmp.execute("getfd", {"fdname": stateload.FD_NAME})
        await qmp.execute("migrate-incoming", {"uri": f"fd:{stateload.FD_NAME}"})

    await stateload.load(path, send, lambda: migration_done(execute, "loading"), preexec)


async def save(send_fd: Callable[[int], None], execute: Execute, path: str) -> None:
    """Stop the guest and write its state to `path` (created; QEMU's migration stream,
    without the root image: it is mapped shared, and every VM maps the same file). The
    file's pages are dropped from the host's page cache once it is on disk. `send_fd`
    passes a descriptor to QEMU over QMP."""
    await execute("stop")
    await execute("migrate-set-capabilities", {"capabilities": SAVE_CAPS})
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
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
