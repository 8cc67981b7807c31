"""Explicit process states. An RPC that is illegal in the current state is an answer
(FAILED_PRECONDITION or NOT_FOUND), never a corrupted state. RPCs are served
concurrently: an operation holds the process's lock from its check, across the agent
call, to its transition, so two of them (Start and Start, Kill and Delete) never both
pass the check of one state."""
from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from podvm_core.pb.containerd.types.task_pb2 import Status
from podvm_core.ttrpc import Code, TtrpcError


class State(Enum):
    CREATED = "created"
    RUNNING = "running"
    PAUSED = "paused"
    STOPPED = "stopped"
    DELETED = "deleted"

    @property
    def status(self) -> int:
        """The containerd.v1.types.Status containerd sees (a deleted process is gone)."""
        return _STATUS[self]


_STATUS = {State.CREATED: Status.CREATED, State.RUNNING: Status.RUNNING,
           State.PAUSED: Status.PAUSED, State.STOPPED: Status.STOPPED,
           State.DELETED: Status.UNKNOWN}

# operation -> {state it is legal in: state it leads to}
TRANSITIONS: dict[str, dict[State, State]] = {
    "start": {State.CREATED: State.RUNNING},
    "pause": {State.RUNNING: State.PAUSED},
    "resume": {State.PAUSED: State.RUNNING},
    "exit": {State.CREATED: State.STOPPED, State.RUNNING: State.STOPPED,
             State.PAUSED: State.STOPPED},
    "delete": {State.CREATED: State.DELETED, State.STOPPED: State.DELETED},
}
# operations that change nothing but need a live process
LIVE_ONLY = {"kill": {State.CREATED, State.RUNNING, State.PAUSED},
             "exec": {State.RUNNING},
             "resize": {State.CREATED, State.RUNNING, State.PAUSED},
             "closeio": {State.CREATED, State.RUNNING, State.PAUSED},
             "update": {State.CREATED, State.RUNNING, State.PAUSED}}


@dataclass(eq=False)
class Process:
    container_id: str
    exec_id: str = ""
    pid: int = 0
    stdin: str = ""
    stdout: str = ""
    stderr: str = ""
    terminal: bool = False
    state: State = State.CREATED
    exit_status: int = 0
    exited_at_ns: int = 0
    process_json: bytes = b""
    """An exec's OCI Process, kept from Exec until Start."""
    io: Any = None
    """The ProcessIO copying its stdio, once the guest process exists."""
    _exited: asyncio.Event = field(default_factory=asyncio.Event, repr=False)
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)

    @property
    def name(self) -> str:
        return f"exec {self.exec_id} of {self.container_id}" if self.exec_id \
            else f"container {self.container_id}"

    def check(self, operation: str) -> None:
        """Raise the answer for `operation` when it is illegal now; change nothing."""
        if self.state is State.DELETED:  # gone for containerd, as if never there
            raise TtrpcError(Code.NOT_FOUND, f"{self.name} not found: it was deleted")
        if operation in LIVE_ONLY:
            if self.state not in LIVE_ONLY[operation]:
                if self.state is State.STOPPED and operation == "kill":
                    raise TtrpcError(Code.NOT_FOUND, f"{self.name}: process already finished")
                raise TtrpcError(Code.FAILED_PRECONDITION,
                                 f"cannot {operation} {self.name}: it is {self.state.value}")
            return
        if self.state not in TRANSITIONS[operation]:
            raise TtrpcError(Code.FAILED_PRECONDITION,
                             f"cannot {operation} {self.name}: it is {self.state.value}")

    def transition(self, operation: str) -> None:
        self.check(operation)
        if operation in TRANSITIONS:
            self.state = TRANSITIONS[operation][self.state]

    @contextlib.asynccontextmanager
    async def acting(self, operation: str):
        """`async with proc.acting("start"): <the agent call>`: one operation at a time
        on this process; checked under the lock, moved to the next state when the body
        succeeds (unless the process exited meanwhile: its exit stands)."""
        async with self._lock:
            self.check(operation)
            yield
            if operation in TRANSITIONS and self.state in TRANSITIONS[operation]:
                self.state = TRANSITIONS[operation][self.state]

    def set_exited(self, status: int, at_ns: int) -> None:
        self.transition("exit")
        self.exit_status, self.exited_at_ns = status, at_ns
        self._exited.set()

    async def wait(self) -> tuple[int, int]:
        await self._exited.wait()
        return self.exit_status, self.exited_at_ns


@dataclass(eq=False)
class Container:
    id: str
    bundle: str
    init: Process
    execs: dict[str, Process] = field(default_factory=dict)

    def process(self, exec_id: str) -> Process:
        if not exec_id:
            return self.init
        proc = self.execs.get(exec_id)
        if proc is None:
            raise TtrpcError(Code.NOT_FOUND, f"exec {exec_id} of container {self.id} not found")
        return proc
