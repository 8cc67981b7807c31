"""The shim's processes. Their states are podvm_core.procstate's, shared with the guest
agent: an RPC that is illegal in the current state is an answer (FAILED_PRECONDITION or
NOT_FOUND), never a corrupted state. RPCs are served concurrently: an operation holds the
process's lock from its check, across the agent call, to its transition
(`Lifecycle.acting`), so two of them (Start and Start, Kill and Delete) never both pass
the check of one state."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from podvm_core.pb.containerd.types.task_pb2 import Status
from podvm_core.procstate import (CREATED, DELETED, PAUSED, RUNNING, STOPPED, Lifecycle,
                                  ProcessState, pick)

_STATUS = {CREATED: Status.CREATED, RUNNING: Status.RUNNING, PAUSED: Status.PAUSED,
           STOPPED: Status.STOPPED, DELETED: Status.UNKNOWN}


def status_of(state: ProcessState) -> int:
    """The containerd.v1.types.Status containerd sees (a deleted process is gone)."""
    return _STATUS[state]


@dataclass(eq=False)
class Process(Lifecycle):
    stdin: str = ""
    stdout: str = ""
    stderr: str = ""
    terminal: bool = False
    process_json: bytes = b""
    """An exec's OCI Process, kept from Exec until Start."""
    io: Any = None
    """The ProcessIO copying its stdio, once the guest process exists."""


@dataclass(eq=False)
class Container:
    id: str
    bundle: str
    init: Process
    execs: dict[str, Process] = field(default_factory=dict)

    def process(self, exec_id: str) -> Process:
        return pick(self.id, self.init, self.execs, exec_id)
