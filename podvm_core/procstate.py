"""A process's lifecycle as containerd's runc shim keeps it (pkg/process/init_state.go):
one object per state, with one method per operation that either names the state the
operation leads to or raises the refusal the caller answers with. The shim on the host
and the agent in the guest hold their processes in the same states, so both refuse the
same operations with the same codes: FAILED_PRECONDITION for an operation the state does
not allow, NOT_FOUND for a signal to a process that has finished and for anything asked
of a deleted one (for containerd it is gone).

`Lifecycle` is what a process record gets from this: its state, its exit, and one lock
held from an operation's check, across the work it does, to its transition, so two
operations on one process (Start and Start, Kill and Delete) never both pass the check
of one state. An exit takes no lock: it is a fact, recorded whenever it is seen."""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping
from typing import TypeVar

from .ttrpc.codes import Code
from .ttrpc.errors import TtrpcError

OPERATIONS = ("start", "delete", "pause", "resume", "exec", "kill", "kill_all", "resize",
              "close_io", "update", "set_exited")
"""`kill_all`: a signal to every process of a container, which may outlive its init.
`exec`: a new process in the container whose init is in this state."""

_VERBS = {"exec": "exec in", "kill": "signal", "kill_all": "signal every process of",
          "resize": "resize the terminal of", "close_io": "close the stdin of",
          "set_exited": "record the exit of"}


class Refused(TtrpcError):
    """An operation the process's state does not allow; nothing was changed."""

    def __init__(self, code: Code, message: str, who: str, operation: str,
                 state: ProcessState) -> None:
        super().__init__(code, message)
        self.who, self.operation, self.state = who, operation, state


def finished(who: str, state: ProcessState) -> Refused:
    """What a signal to a process that has exited answers (also when its exit is still
    on its way): the CRI takes NOT_FOUND "process already finished" as stopped."""
    return Refused(Code.NOT_FOUND, f"{who}: process already finished", who, "kill", state)


class ProcessState:
    """One state. Each operation returns the next state (itself when the operation
    changes nothing) or raises Refused; `who` names the process in the message."""

    name = ""
    live = True
    """Its process may still run: it has neither exited nor been deleted."""

    def after(self, operation: str, who: str) -> ProcessState:
        if operation not in OPERATIONS:
            raise ValueError(f"no operation {operation!r} on a process")
        return getattr(self, operation)(who)

    def allows(self, operation: str) -> bool:
        try:
            self.after(operation, "")
        except Refused:
            return False
        return True

    def refuse(self, operation: str, who: str) -> Refused:
        verb = _VERBS.get(operation, operation)
        return Refused(Code.FAILED_PRECONDITION, f"cannot {verb} {who}: it is {self.name}",
                       who, operation, self)

    def start(self, who: str) -> ProcessState:
        raise self.refuse("start", who)

    def delete(self, who: str) -> ProcessState:
        raise self.refuse("delete", who)

    def pause(self, who: str) -> ProcessState:
        raise self.refuse("pause", who)

    def resume(self, who: str) -> ProcessState:
        raise self.refuse("resume", who)

    def exec(self, who: str) -> ProcessState:
        raise self.refuse("exec", who)

    def kill(self, who: str) -> ProcessState:
        return self

    def kill_all(self, who: str) -> ProcessState:
        return self

    def resize(self, who: str) -> ProcessState:
        return self

    def close_io(self, who: str) -> ProcessState:
        return self

    def update(self, who: str) -> ProcessState:
        return self

    def set_exited(self, who: str) -> ProcessState:
        return STOPPED

    def __repr__(self) -> str:
        return f"<{self.name}>"


class Created(ProcessState):
    """Made (runc create, or an exec recorded), not started. Exec in it is refused, as
    podvm always has: an exec joins a container that runs."""

    name = "created"

    def start(self, who: str) -> ProcessState:
        return RUNNING

    def delete(self, who: str) -> ProcessState:
        return DELETED


class Running(ProcessState):
    name = "running"

    def pause(self, who: str) -> ProcessState:
        return PAUSED

    def exec(self, who: str) -> ProcessState:
        return self


class Paused(ProcessState):
    name = "paused"

    def resume(self, who: str) -> ProcessState:
        return RUNNING


class Stopped(ProcessState):
    """Exited; its status is known. Only Delete moves it on; a second exit is no news.
    Signalling its container's leftovers (kill_all) is still allowed."""

    name = "stopped"
    live = False

    def delete(self, who: str) -> ProcessState:
        return DELETED

    def kill(self, who: str) -> ProcessState:
        raise finished(who, self)

    def resize(self, who: str) -> ProcessState:
        raise self.refuse("resize", who)

    def close_io(self, who: str) -> ProcessState:
        raise self.refuse("close_io", who)

    def update(self, who: str) -> ProcessState:
        raise self.refuse("update", who)

    def set_exited(self, who: str) -> ProcessState:
        return self


class Deleted(ProcessState):
    """Gone for containerd, as if never there: every operation is NOT_FOUND, an exit
    that comes late changes nothing."""

    name = "deleted"
    live = False

    def refuse(self, operation: str, who: str) -> Refused:
        return Refused(Code.NOT_FOUND, f"{who} not found: it was deleted", who, operation,
                       self)

    def kill(self, who: str) -> ProcessState:
        raise self.refuse("kill", who)

    def kill_all(self, who: str) -> ProcessState:
        raise self.refuse("kill_all", who)

    def resize(self, who: str) -> ProcessState:
        raise self.refuse("resize", who)

    def close_io(self, who: str) -> ProcessState:
        raise self.refuse("close_io", who)

    def update(self, who: str) -> ProcessState:
        raise self.refuse("update", who)

    def set_exited(self, who: str) -> ProcessState:
        return self


CREATED, RUNNING, PAUSED = Created(), Running(), Paused()
STOPPED, DELETED = Stopped(), Deleted()
STATES = (CREATED, RUNNING, PAUSED, STOPPED, DELETED)


class Lifecycle:
    """A process as both sides keep it: where it is in its life, how it ended, and the
    lock that makes its operations one at a time. A plain class, not a dataclass: the
    guest agent imports it before it serves, and making a dataclass costs ~20 ms of
    that under TCG."""

    def __init__(self, container_id: str, exec_id: str = "", pid: int = 0,
                 state: ProcessState = CREATED) -> None:
        self.container_id = container_id
        self.exec_id = exec_id
        self.pid = pid
        self.state = state
        self.exit_status = 0
        self.exited_at_ns = 0
        self.exited = asyncio.Event()
        self.lock = asyncio.Lock()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} pid {self.pid} {type(self.state).__name__}>"

    @property
    def name(self) -> str:
        return f"exec {self.exec_id} of container {self.container_id}" if self.exec_id \
            else f"container {self.container_id}"

    def check(self, operation: str) -> None:
        """Raise the answer for `operation` when it is illegal now; change nothing."""
        self.state.after(operation, self.name)

    @contextlib.asynccontextmanager
    async def acting(self, operation: str) -> AsyncIterator[None]:
        """`async with proc.acting("start"): <the work>`: checked under the lock, moved
        on when the work succeeds. An exit that came meanwhile stands unless the
        operation also leads on from it (Delete of a process that exited)."""
        async with self.lock:
            self.check(operation)
            yield
            if self.state.allows(operation):
                self.state = self.state.after(operation, self.name)

    def set_exited(self, status: int, at_ns: int) -> bool:
        """Record the exit (the first one seen: waiters are released even when the
        process was deleted first); True when it moved the process on, i.e. is news."""
        before = self.state
        self.state = before.set_exited(self.name)
        if not self.exited.is_set():
            self.exit_status, self.exited_at_ns = status, at_ns
            self.exited.set()
        return self.state is not before

    async def wait(self) -> tuple[int, int]:
        await self.exited.wait()
        return self.exit_status, self.exited_at_ns


P = TypeVar("P", bound=Lifecycle)


def pick(container_id: str, init: P, execs: Mapping[str, P], exec_id: str) -> P:
    """A container's process by exec id ("" is its init); NOT_FOUND for an unknown exec."""
    if not exec_id:
        return init
    proc = execs.get(exec_id)
    if proc is None:
        raise TtrpcError(Code.NOT_FOUND, f"exec {exec_id} of container {container_id} not found")
    return proc
