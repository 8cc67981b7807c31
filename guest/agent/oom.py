"""Which containers the guest's OOM killer struck, told to the host once each and in
order with their exits. Kills are counted from each container cgroup's memory.events
`oom_kill`: by a poll while the container runs (GetOOMEvent), and when its init exits
(WaitProcess). An init killed for its memory usually takes the whole container with it,
and the host removes the container (runc deletes its cgroup) as soon as it hears of the
exit, before any poll could see the kill: so the exit carries the kills not yet told,
and containerd hears its TaskOOM before its TaskExit, as containerd's runc shim sends
them."""
from __future__ import annotations

import asyncio
from typing import Callable, Iterable

from . import resources

POLL_SECONDS = 0.5


class OOMKills:
    def __init__(self) -> None:
        self._counted: dict[str, int] = {}
        """oom_kill as last read, per container."""
        self._untold: list[str] = []
        """Containers with kills the host has not heard of, in the order they came."""
        self._arrived = asyncio.Event()

    def count(self, container_id: str) -> None:
        """Read the container's oom_kill: a new kill makes it untold."""
        kills = resources.oom_kills(container_id)
        if kills > self._counted.get(container_id, 0) and container_id not in self._untold:
            self._untold.append(container_id)
            self._arrived.set()
        self._counted[container_id] = kills

    async def next(self) -> str:
        """The next container with untold kills, once told (GetOOMEvent)."""
        while not self._untold:
            self._arrived.clear()
            await self._arrived.wait()
        return self._untold.pop(0)

    def take_at_exit(self, container_id: str) -> bool:
        """The container's init has exited: whether it has kills not yet told, which are
        told now with the exit (WaitProcess) and never again on their own. The answer is
        on the wire in the same step as the take, as next()'s is: whichever takes a kill,
        the host reads it before the exit."""
        self.count(container_id)
        if container_id not in self._untold:
            return False
        self._untold.remove(container_id)
        return True

    def forget(self, container_id: str) -> None:
        """The container is removed (its cgroup goes, and its id may come again)."""
        self._counted.pop(container_id, None)
        if container_id in self._untold:
            self._untold.remove(container_id)

    async def watch(self, containers: Callable[[], Iterable[str]]) -> None:
        """Count every container's kills, forever."""
        while True:
            await asyncio.sleep(POLL_SECONDS)
            for container_id in list(containers()):
                self.count(container_id)
