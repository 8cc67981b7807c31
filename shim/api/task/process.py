"""The shim's processes. Their states are podvm_core.procstate's, shared with the guest
agent: an RPC that is illegal in the current state is an answer (FAILED_PRECONDITION or
NOT_FOUND), never a corrupted state. RPCs are served concurrently: an operation holds the
process's lock from its check, across the agent call, to its transition
(`Lifecycle.acting`), so two of them (Start and Start, Kill and Delete) never both pass
the check of one state."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from podvm_core.pb.containerd.types.task_pb2 import Status
from podvm_core.procstate import (CREATED, DELETED, PAUSED, RUNNING, STOPPED, Lifecycle,
                                  ProcessState, pick)
from podvm_core.ttrpc import Code, TtrpcError

from ..errors import to_ttrpc
from ...pod.errors import PodError

if TYPE_CHECKING:
    from ...pod.pod import Pod

log = logging.getLogger("podvm.task")

_STATUS = {CREATED: Status.CREATED, RUNNING: Status.RUNNING, PAUSED: Status.PAUSED,
           STOPPED: Status.STOPPED, DELETED: Status.UNKNOWN}


def status_of(state: ProcessState) -> int:
    """The containerd.v1.types.Status containerd sees (a deleted process is gone)."""
    return _STATUS[state]


class Process(Lifecycle):
    def __init__(self, container_id: str, exec_id: str = "", pid: int = 0,
                 state: ProcessState = CREATED, *, stdin: str = "", stdout: str = "",
                 stderr: str = "", terminal: bool = False, process_json: bytes = b"") -> None:
        super().__init__(container_id, exec_id, pid, state)
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr
        self.terminal = terminal
        self.process_json = process_json
        """An exec's OCI Process, kept from Exec until Start."""
        self.io: Any = None
        """The ProcessIO copying its stdio, once the guest process exists."""

    async def stop_io(self) -> None:
        if self.io is not None:
            await self.io.close()

    async def forget_in_guest(self, pod: Callable[[], Pod]) -> None:
        """An exec's Delete reaches the guest, which forgets the exec and closes the
        stdio it holds: else the agent keeps every exec a kubelet probe ever ran, and
        refuses its id again. NOT_FOUND is done (forgotten, or its container gone);
        anything else, a VM that is gone included, is only logged: the host has
        forgotten the exec already, and containerd's Delete of it succeeds."""
        if self.io is None:
            return  # never started: the guest never had it
        try:
            await pod().containers.forget_exec(self.container_id, self.exec_id)
        except (TtrpcError, PodError) as exc:
            answer = to_ttrpc(exc)
            if answer.code != Code.NOT_FOUND:
                log.warning("%s: deleted, but the guest could not forget it: %s",
                            self.name, answer)


@dataclass(eq=False)
class Container:
    id: str
    bundle: str
    init: Process
    execs: dict[str, Process] = field(default_factory=dict)

    def process(self, exec_id: str) -> Process:
        return pick(self.id, self.init, self.execs, exec_id)
