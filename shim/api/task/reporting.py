"""How containerd hears about a pod's processes: events, published in order, and exits,
from the guest when it reports them or assumed when the VM goes from under them. An OOM
kill the guest reports with a container's exit is published before it, as containerd's
runc shim does: CRI's container status then reads OOMKilled.

The guest is not trusted: an OOM kill or exit is published only for a container of this
pod (a guest could otherwise publish TaskOOM for any container id on the node's event
bus); the others are dropped, with a rate-limited warning. An exit's time is the guest's
only when it is a plausible one.

Reporting goes one way: the reporter waits for exits through the Pod's containers
(Containers.wait in shim/pod/containers.py, which also drops a container whose init ended
from their table) and never calls back into it."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Callable, Iterable

from google.protobuf.timestamp_pb2 import Timestamp

from podvm_core.pb.containerd.events import task_pb2 as events
from podvm_core.ttrpc import TtrpcError

from ..events import Publisher
from ...pod.errors import PodError
from ...pod.exitstatus import VM_GONE_STATUS
from podvm_core.ratelimit import LimitedLog
from .process import Container, Process

if TYPE_CHECKING:
    from ...pod.pod import Pod

log = logging.getLogger("podvm.task")

_CLOCK_SLACK_NS = 60 * 10**9
"""How far in the future a guest's exit time may be (its clock may run ahead a little)."""


class Reporter:
    def __init__(self, publisher: Publisher | None,
                 containers: Mapping[str, Container]) -> None:
        """`containers`: this pod's, as the Task service holds them (live view)."""
        self._publisher = publisher
        self._containers = containers
        self._background: set[asyncio.Task] = set()
        self._foreign = LimitedLog(log)

    def _ours(self, container_id: str, what: str) -> bool:
        if container_id in self._containers:
            return True
        self._foreign.warning("the guest reported %s of %r, which is no container of this "
                              "pod: dropped", what, container_id[:100])
        return False

    def publish(self, topic: str, event) -> None:
        if self._publisher is not None:
            self._publisher.publish(topic, event)

    def watch(self, proc: Process, pod: Callable[[], Pod]) -> None:
        """A started process: report its exit when the guest does (`pod`: the one it
        runs in, when asked)."""
        task = asyncio.create_task(self._reap(proc, pod))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _reap(self, proc: Process, pod: Callable[[], Pod]) -> None:
        """Wait for the guest process to exit, let its output drain, report the exit
        (and the OOM kill that came with it first)."""
        try:
            result = await pod().containers.wait(proc.container_id, proc.exec_id)
            status, at_ns = result.exit_status, _plausible(result.exited_at)
        except (TtrpcError, PodError) as exc:
            log.warning("%s: lost track of the process: %s", proc.name, exc)
            status, at_ns = VM_GONE_STATUS, time.time_ns()
        else:
            if result.oom_killed:
                self.oom(proc.container_id)
        if proc.io is not None:
            await proc.io.drained()
        self.exited(proc, status, at_ns or time.time_ns())

    def exited(self, proc: Process, status: int, at_ns: int) -> None:
        """`proc` ended with `status`: containerd hears it once."""
        if not proc.set_exited(status, at_ns) or not self._ours(proc.container_id, "an exit"):
            return
        event = events.TaskExit(container_id=proc.container_id,
                                id=proc.exec_id or proc.container_id, pid=proc.pid,
                                exit_status=status)
        event.exited_at.FromNanoseconds(at_ns)
        self.publish("/tasks/exit", event)

    def oom(self, container_id: str) -> None:
        """The guest's OOM killer struck the container (the guest says which)."""
        if not self._ours(container_id, "an OOM kill"):
            return
        log.warning("container %s: out of memory in the guest", container_id)
        self.publish("/tasks/oom", events.TaskOOM(container_id=container_id))

    def deleted(self, proc: Process, exited_at) -> None:
        event = events.TaskDelete(container_id=proc.container_id, id=proc.container_id,
                                  pid=proc.pid, exit_status=proc.exit_status)
        event.exited_at.CopyFrom(exited_at)
        self.publish("/tasks/delete", event)

    def end(self, containers: Iterable[Container], status: int) -> None:
        """The VM is gone from under these processes: each one still alive has exited
        with `status`."""
        now = time.time_ns()
        for container in list(containers):
            for proc in (container.init, *container.execs.values()):
                if proc.state.live:
                    self.exited(proc, status, now)


def _plausible(at: Timestamp) -> int:
    """A guest's exit time in ns, or 0 (now) when it is none a real exit could have.
    Read from the fields: ToNanoseconds() raises on a time past the year 9999, and a
    reaper that raised would never report the exit."""
    at_ns = at.seconds * 10**9 + at.nanos
    return at_ns if 0 < at_ns <= time.time_ns() + _CLOCK_SLACK_NS else 0
