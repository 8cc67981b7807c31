"""The pod's network worker (shim/network/remote.py), started ahead once for each of the
two things a pod's network needs: the boot's attach, and the detach as the VM stops.
Whoever first knows that the pod has a network starts the attach's: the daemon, from its
sandbox container's spec, before containerd sends the Create that boots the pod
(shim/contract/daemon.py); CreateSandbox, before its StartSandbox; at the latest the boot
itself, before it plans (shim/pod/pod.py). The Machine starts the detach's as its
shutdown begins (shim/vm/machine.py). A worker forked by the fork server's worker parent
is ready at once; one started here has its Python start and pyroute2's import overlap
what comes before it is used.

The shim's PodSlot holds its one WorkerAhead (shim/pod/podslot.py) and the pods made in
the slot boot with it: the Pod's Machine attaches and detaches through it, the boot's end
closes the attach's worker, as do a pod stopped before it booted and the daemon's exit.

Nothing is imported at the top: the idle daemon holds one, and a pod without a network
never starts a worker."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import socket

    from .model import PodNetwork, TapNic
    from .remote import Worker


class WorkerAhead:
    def __init__(self, parent: socket.socket | None = None) -> None:
        self._worker: Worker | None = None
        """Started for the next request; None before its start, once it is given one, and
        once closed."""
        self._used: list[Worker] = []
        """Given their request: close() waits for their exit (a boot that failed after its
        attach detaches through the next worker before the boot closes this one)."""
        self._parent = parent
        """The fork server's worker parent (shim/contract/workerparent.py), when it forked
        this daemon: each start() asks it for a worker forked loaded, and starts one of
        its own only when the parent is gone."""

    async def start(self) -> None:
        """Start the worker now, unless there is one: its start overlaps whatever the
        caller goes on with."""
        await self._started()

    async def attach(self, netns: str, found: Callable[[PodNetwork], None] | None = None
                     ) -> tuple[PodNetwork, tuple[TapNic, ...]]:
        """Worker.attach() by the worker started ahead, else by one started now. It
        serves this one request; close() waits for its exit."""
        return await (await self._taken()).attach(netns, found)

    async def detach(self, netns: str, taps: list[str] | tuple[str, ...] = ()) -> None:
        """Worker.detach() by the worker started ahead, else by one started now; closed
        after, whatever the outcome."""
        try:
            await (await self._taken()).detach(netns, taps)
        finally:
            await self.close()

    async def close(self) -> None:
        """End the worker, used or not: the boot or the detach is over, the pod it was
        started for stopped before it booted, or the daemon is exiting. The next start()
        starts another. Idempotent."""
        workers, self._used = self._used, []
        worker, self._worker = self._worker, None
        for each in workers + ([worker] if worker is not None else []):
            await each.close()

    async def _taken(self) -> Worker:
        """The worker started ahead (else one started now), for one request: the next
        start() starts another."""
        worker = await self._started()
        self._worker = None
        self._used.append(worker)
        return worker

    async def _started(self) -> Worker:
        if self._worker is not None:
            return self._worker
        # Here, not at the top: see the module's docstring.
        from .remote import Worker

        forked = Worker.forked(self._parent) if self._parent is not None else None
        worker = forked or await Worker.start()
        if self._worker is None:
            self._worker = worker
            return worker
        # Another was started meanwhile (the boot's own, its Create having come first, or
        # the one started ahead): that one serves, and this one ends having done nothing.
        await worker.close()
        return await self._started()
