"""QEMU's monitor (QMP) for the driver (shim/vm/qemu/driver.py): connected as soon as QEMU
listens, let go, and what QEMU says on it unasked that the pod must hear of: the VM
stopped. A stop is news when the shim did not ask for it (its only stop of its own is a
template's save, shim/vm/qemu/state.py); QEMU's run state then says why (`io-error`,
`paused`, `internal-error`, `guest-panicked`...). The scratch disk reports its errors to
the guest (shim/vm/qemu/command.py, werror and rerror `report`), so a full host file
system pauses no VM; each `BLOCK_IO_ERROR` QEMU reports is still logged, at a rate the
guest cannot raise (it makes them by writing). What the pod does about a stop is its
own (shim/pod/pod.py)."""
from __future__ import annotations

import asyncio
import logging
from typing import Callable

from qemu.qmp import ConnectError, QMPClient

from podvm_core.ratelimit import LimitedLog

from .. import workdir
from .query import Execute

log = logging.getLogger("podvm.qemu")

STOPPED_STATES = frozenset(("paused", "io-error", "internal-error", "guest-panicked",
                            "watchdog", "debug", "suspended"))
"""QEMU's run states (query-status) of a VM that stopped and will not go on by itself;
`shutdown` and the migration states are a VM ending or being saved, not stopped."""


async def connect(qmp: QMPClient, path: str, opened: Callable[[], None]) -> None:
    """`qmp` connected to QEMU's socket at `path` (beneath the work directory's
    descriptor), waiting for QEMU to listen; `opened` is told when the socket is there."""
    while True:  # the socket file appears a moment before QEMU listens on it
        try:
            with workdir.socket_path(path) as sock:
                opened()
                await qmp.connect(sock)
                return
        except FileNotFoundError:
            pass
        except ConnectError as exc:
            if not isinstance(exc.__cause__, ConnectionRefusedError):
                raise
            log.debug("QMP not listening yet: %s", exc)
        await asyncio.sleep(0.005)


async def disconnect(qmp: QMPClient | None) -> None:
    if qmp is not None:
        try:
            await qmp.disconnect()
        except Exception as exc:  # QEMU may already be gone
            log.debug("QMP disconnect: %s", exc)


class RunWatch:
    """The run state of one VM, on the driver's QMP connection."""

    def __init__(self, sandbox_id: str) -> None:
        self._sandbox_id = sandbox_id
        self.saving = False
        """The shim stopped the VM itself to save it: its STOP is no news."""
        self._disk_errors = LimitedLog(log, interval=30.0)

    async def unasked_stop(self, qmp: QMPClient, execute: Execute) -> str:
        """Until QEMU stops the VM without the shim asking; QEMU's run state then. A VM
        stopped already when this begins counts (the listener is on before the ask)."""
        with qmp.listener(names=("STOP", "BLOCK_IO_ERROR")) as events:
            state = await self._stopped(execute)
            if state:
                return state
            async for event in events:
                if event.get("event") == "BLOCK_IO_ERROR":
                    self._disk_error(event.get("data") or {})
                    continue
                state = await self._stopped(execute)
                if state:
                    return state
        raise AssertionError("the listener ended")  # it ends only when QMP does (raised)

    async def _stopped(self, execute: Execute) -> str:
        """QEMU's run state when the VM is stopped and the shim did not stop it; ""
        otherwise."""
        if self.saving:
            return ""
        status = await execute("query-status")
        state = str(status.get("status", ""))  # type: ignore[union-attr]
        running = status.get("running")  # type: ignore[union-attr]
        return state if not running and state in STOPPED_STATES else ""

    def _disk_error(self, data: dict) -> None:
        self._disk_errors.warning(
            "sandbox %s: QEMU reports a %s error on %s: %s (%s; the guest sees an I/O "
            "error)", self._sandbox_id, str(data.get("operation", "?"))[:20],
            str(data.get("node-name") or data.get("device") or "?")[:40],
            str(data.get("reason", "?"))[:200],
            "the host's file system is full" if data.get("nospace") else "not for space")
