"""Which containers the guest's OOM killer struck, told to the host once each and in
order with their exits. Kills are counted from each container cgroup's memory.events
`oom_kill`: whenever the kernel changes that file while the container runs (inotify:
cgroup v2 reports every change of memory.events as a modification), and when its init
exits (WaitProcess). An init killed for its memory usually takes the whole container
with it, and the host removes the container (runc deletes its cgroup) as soon as it
hears of the exit, perhaps before the notification is read: so the exit carries the
kills not yet told, and containerd hears its TaskOOM before its TaskExit, as
containerd's runc shim sends them.

Notification, not a poll: a timer in an idle guest costs its QEMU CPU under TCG (a poll
twice a second was about half of an idle VM's)."""
from __future__ import annotations

import asyncio
import os
import struct

from . import libc, resources

IN_MODIFY = 0x2
IN_IGNORED = 0x8000
_EVENT = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len (then name)


class _Inotify:
    """inotify(7) through libc (guest/agent/libc.py)."""

    def __init__(self) -> None:
        self.fd = libc.inotify_init(os.O_NONBLOCK | os.O_CLOEXEC)

    def add_watch(self, path: str, mask: int) -> int:
        return libc.inotify_add_watch(self.fd, path, mask)

    def rm_watch(self, wd: int) -> None:
        libc.inotify_rm_watch(self.fd, wd)  # gone already if its cgroup went

    def read(self) -> list[tuple[int, int]]:
        """(wd, mask) of each pending event; none if nothing is pending."""
        try:
            data = os.read(self.fd, 64 * 1024)
        except BlockingIOError:
            return []
        events, offset = [], 0
        while offset < len(data):
            wd, mask, _, length = _EVENT.unpack_from(data, offset)
            events.append((wd, mask))
            offset += _EVENT.size + length
        return events


class OOMKills:
    def __init__(self) -> None:
        self._counted: dict[str, int] = {}
        """oom_kill as last read, per container."""
        self._untold: list[str] = []
        """Containers with kills the host has not heard of, in the order they came."""
        self._arrived = asyncio.Event()
        self._inotify: _Inotify | None = None
        self._watches: dict[int, str] = {}
        """inotify watch -> container whose memory.events it watches."""

    def count(self, container_id: str) -> None:
        """Read the container's oom_kill: a new kill makes it untold."""
        kills = resources.oom_kills(container_id)
        if kills > self._counted.get(container_id, 0) and container_id not in self._untold:
            self._untold.append(container_id)
            self._arrived.set()
        self._counted[container_id] = kills

    def watch(self, container_id: str) -> None:
        """Count the container's kills as they come, from now on (its cgroup exists).
        A container without a cgroup of its own (the pod's holder) has none to count."""
        path = os.path.join(resources.CGROUP, container_id, "memory.events")
        if not os.path.exists(path):
            return
        if self._inotify is None:
            self._inotify = _Inotify()
            asyncio.get_running_loop().add_reader(self._inotify.fd, self._notified)
        self._watches[self._inotify.add_watch(path, IN_MODIFY)] = container_id
        self.count(container_id)  # a kill before the watch was set

    def _notified(self) -> None:
        assert self._inotify is not None
        for wd, mask in self._inotify.read():
            container_id = self._watches.get(wd)
            if container_id is None:
                continue
            if mask & IN_IGNORED:  # the cgroup was removed
                del self._watches[wd]
            else:
                self.count(container_id)

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
        for wd in [wd for wd, c in self._watches.items() if c == container_id]:
            del self._watches[wd]
            if self._inotify is not None:
                self._inotify.rm_watch(wd)
