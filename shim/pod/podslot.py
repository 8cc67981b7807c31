"""The shim's one pod, shared by the Task and Sandbox APIs without either calling the
other: the Sandbox API creates the pod before it boots, the Task API boots one for a
sandbox container; each API listens to whichever pod the slot holds. The daemon makes the
slot and gives it to both. The slot also holds the pod's network worker
(shim/network/ahead.py): started ahead by the daemon or by CreateSandbox, the pods made in
the slot boot with it."""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..network.ahead import WorkerAhead

if TYPE_CHECKING:
    import socket

    from .pod import Pod, PodListener


class PodSlot:
    def __init__(self, worker_parent: socket.socket | None = None) -> None:
        """`worker_parent`: the socket of the fork server's worker parent, when it
        forked the daemon (shim/contract/workerparent.py)."""
        self.pod: Pod | None = None
        self.sandbox_api_owner = ""
        """The Sandbox-API sandbox that owns this shim until its ShutdownSandbox, which
        alone ends the shim ("": none). containerd 2.x deletes the containers' tasks, and
        asks the Task API to shut down, before it stops and shuts down the sandbox."""
        self.network_worker = WorkerAhead(worker_parent)
        """The pod's network worker: started ahead for the pod to come, which boots with
        it."""
        self._listeners: list[PodListener] = []

    def listen(self, listener: PodListener) -> None:
        """`listener` hears every pod this slot takes from now on."""
        self._listeners.append(listener)

    def take(self, pod: Pod) -> None:
        """Hold `pod` (before it boots: its watchers tell the listeners) until it is
        stopped; then the slot is free for a pod booted anew."""
        for listener in self._listeners:
            pod.listen(listener)
        pod.listen(_Release(self, pod))
        self.pod = pod

    async def close(self) -> None:
        """A network worker no boot used ends: the daemon is exiting, or the pod it was
        started for stopped before it booted."""
        await self.network_worker.close()


class _Release:
    def __init__(self, slot: PodSlot, pod: Pod) -> None:
        self._slot, self._pod = slot, pod

    def vm_stopped(self) -> None:
        if self._slot.pod is self._pod:
            self._slot.pod = None

    def vm_exited(self, error, status: int) -> None:
        pass  # the pod stays: it answers with how its VM ended

    def container_oom(self, container_id: str) -> None:
        pass
