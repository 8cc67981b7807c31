"""The pod's network worker (shim/network/remote.py), started ahead once and used by the
boot that attaches the pod's network. Whoever first knows that the pod has a network
starts it: the daemon, from its sandbox container's spec, before containerd sends the
Create that boots the pod (shim/contract/daemon.py); CreateSandbox, before its
StartSandbox; at the latest the boot itself, before it plans (shim/pod/pod.py). The
worker's Python start and pyroute2's import then overlap what comes before the attach.

The shim's PodSlot holds its one WorkerAhead (shim/pod/podslot.py) and the pods made in
the slot boot with it: the Pod's Machine attaches through it (shim/vm/machine.py), and
the boot's end closes it, as do a pod stopped before it booted and the daemon's exit.

Nothing is imported at the top: the idle daemon holds one, and a pod without a network
never starts it."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import socket

    from .model import PodNetwork, TapNic
    from .remote import Worker


class WorkerAhead:
    def __init__(self, spare: socket.socket | None = None) -> None:
        self._worker: Worker | None = None
        """Started for the next attach, or serving it; None before its start and once
        closed."""
        self._spare = spare
        """The fork server's spare worker, loaded already (shim/contract/spareworker.py):
        the first start() takes it; close() ends it unused."""

    async def start(self) -> None:
        """Start the worker now, unless there is one: its start overlaps whatever the
        caller goes on with."""
        await self._started()

    async def attach(self, netns: str, found: Callable[[PodNetwork], None] | None = None
                     ) -> tuple[PodNetwork, tuple[TapNic, ...]]:
        """Worker.attach() by the worker started ahead, else by one started now. It
        serves this one request; close() waits for its exit."""
        worker = await self._started()
        return await worker.attach(netns, found)

    async def close(self) -> None:
        """End the worker, used or not: the boot is over, the pod it was started for
        stopped before it booted, or the daemon is exiting. The next start() starts
        another. Idempotent."""
        worker, self._worker = self._worker, None
        if worker is not None:
            await worker.close()
        spare, self._spare = self._spare, None
        if spare is not None:
            spare.close()  # the spare sees it and exits having done nothing

    async def _started(self) -> Worker:
        if self._worker is not None:
            return self._worker
        # Here, not at the top: see the module's docstring.
        from .remote import Worker

        spare, self._spare = self._spare, None
        worker = Worker.of_spare(spare) if spare is not None else await Worker.start()
        if self._worker is None:
            self._worker = worker
            return worker
        # Another was started meanwhile (the boot's own, its Create having come first, or
        # the one started ahead): that one serves, and this one ends having done nothing.
        await worker.close()
        return await self._started()
