"""The shim's one pod, shared by the Task and Sandbox APIs without either calling the
other: the Sandbox API creates the pod before it boots, the Task API boots one for a
sandbox container; each API listens to whichever pod the slot holds. The daemon makes the
slot and gives it to both. The slot also keeps the network worker started ahead for the
pod's boot (by the daemon, or by CreateSandbox), until a boot takes it."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..network import remote
    from .pod import Pod, PodListener

VM_GONE_STATUS = 255
"""Exit status of a process whose VM died under it."""
KILLED_STATUS = 137
"""Exit status of a process whose VM was stopped under it (128 + SIGKILL)."""


class PodSlot:
    def __init__(self) -> None:
        self.pod: Pod | None = None
        self.sandbox_api_owner = ""
        """The Sandbox-API sandbox that owns this shim until its ShutdownSandbox, which
        alone ends the shim ("": none). containerd 2.x deletes the containers' tasks, and
        asks the Task API to shut down, before it stops and shuts down the sandbox."""
        self._listeners: list[PodListener] = []
        self._network_worker: remote.Worker | None = None

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

    def keep_network_worker(self, worker: remote.Worker) -> bool:
        """Keep `worker`, started ahead, for the next boot; False (the caller closes it)
        when there is a pod already (its Create came first: its boot starts its own) or
        a worker kept already."""
        if self.pod is not None or self._network_worker is not None:
            return False
        self._network_worker = worker
        return True

    def pop_network_worker(self) -> remote.Worker | None:
        """The worker kept for a boot, now the caller's (Pod.boot closes it)."""
        worker, self._network_worker = self._network_worker, None
        return worker

    async def close(self) -> None:
        """A worker no boot took ends: the daemon is exiting, or the pod it was kept for
        stopped before it booted."""
        worker = self.pop_network_worker()
        if worker is not None:
            await worker.close()


class _Release:
    def __init__(self, slot: PodSlot, pod: Pod) -> None:
        self._slot, self._pod = slot, pod

    def vm_stopped(self) -> None:
        if self._slot.pod is self._pod:
            self._slot.pod = None

    def vm_exited(self, error) -> None:
        pass  # the pod stays: it answers with how its VM ended

    def container_oom(self, container_id: str) -> None:
        pass
