"""Process lifecycle as containerd sees it: every state-dependent Task RPC, in every state,
through TaskService's handlers. Expected outcomes come from containerd's runc shim
(cmd/containerd-shim-runc-v2/process/init_state.go and exec_state.go) and docs/design.md,
Task API processes, not from shim.api.task.process: a refused call answers a code, names the process
and its state, and changes nothing containerd can observe (State, events).

The service here has no VM. A legal call that needs the guest agent can only show that its
state let it through (it answers as any call needing the agent does); what it does in the
guest is for the end-to-end tests. Legal calls that need no agent are checked in full."""
from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

import pytest
from google.protobuf.any_pb2 import Any
from google.protobuf.message import Message

from podvm_core.pb.containerd.task.v2 import shim_pb2 as api
from podvm_core.ttrpc import Code, Context, TtrpcError
from podvm_core.procstate import CREATED, PAUSED, RUNNING, STOPPED, ProcessState
from shim.api.task.process import Container, Process
from shim.api.task.service import TaskService

CTX = Context("containerd.task.v2.Task", "x")
CID, EID, NEW_EID = "ctr-7", "exec-3", "exec-new"
PID = 4242
EXIT, EXITED_AT = 3, 1_700_000_000_123_456_789
FP, NF = Code.FAILED_PRECONDITION, Code.NOT_FOUND

# containerd.v1.types.Status numbers (protos/podvm_core/pb/containerd/types/task.proto).
STATUS = {CREATED: 1, RUNNING: 2, STOPPED: 3, PAUSED: 4}

PROCESS_SPEC = Any(type_url="types.containerd.io/opencontainers/runtime-spec/1/Process",
                   value=json.dumps({"args": ["true"], "cwd": "/"}).encode())
RESOURCES = Any(type_url="types.containerd.io/opencontainers/runtime-spec/1/LinuxResources",
                value=json.dumps({"cpu": {"shares": 512}}).encode())

Call = Callable[[TaskService, str, str], Awaitable[Message]]
CALLS: dict[str, Call] = {
    "Start": lambda s, c, e: s.Start(api.StartRequest(id=c, exec_id=e), CTX),
    "Kill": lambda s, c, e: s.Kill(api.KillRequest(id=c, exec_id=e, signal=15), CTX),
    "Pause": lambda s, c, e: s.Pause(api.PauseRequest(id=c), CTX),
    "Resume": lambda s, c, e: s.Resume(api.ResumeRequest(id=c), CTX),
    "Delete": lambda s, c, e: s.Delete(api.DeleteRequest(id=c, exec_id=e), CTX),
    "Exec": lambda s, c, e: s.Exec(api.ExecProcessRequest(id=c, exec_id=NEW_EID,
                                                          spec=PROCESS_SPEC), CTX),
    "ResizePty": lambda s, c, e: s.ResizePty(
        api.ResizePtyRequest(id=c, exec_id=e, width=80, height=24), CTX),
    "CloseIO": lambda s, c, e: s.CloseIO(api.CloseIORequest(id=c, exec_id=e, stdin=True), CTX),
    "Update": lambda s, c, e: s.Update(api.UpdateTaskRequest(id=c, resources=RESOURCES), CTX),
    "Wait": lambda s, c, e: s.Wait(api.WaitRequest(id=c, exec_id=e), CTX),
    "State": lambda s, c, e: s.State(api.StateRequest(id=c, exec_id=e), CTX),
}
# RPCs that address one process of a container (the others act on the container).
PER_PROCESS = ["Start", "Kill", "Delete", "ResizePty", "CloseIO", "Wait", "State"]

# The container's init process, as the runc shim answers. Kill of a finished process is
# NOT_FOUND ("process already finished"): CRI takes that as already stopped.
INIT_REFUSED: dict[tuple[str, ProcessState], Code] = {
    ("Start", RUNNING): FP, ("Start", PAUSED): FP, ("Start", STOPPED): FP,
    ("Kill", STOPPED): NF,
    ("Pause", CREATED): FP, ("Pause", PAUSED): FP, ("Pause", STOPPED): FP,
    ("Resume", CREATED): FP, ("Resume", RUNNING): FP, ("Resume", STOPPED): FP,
    ("Delete", RUNNING): FP, ("Delete", PAUSED): FP,
    ("Exec", PAUSED): FP, ("Exec", STOPPED): FP,
    ("Update", STOPPED): FP,
}
INIT_NEEDS_VM: set[tuple[str, ProcessState]] = {
    ("Start", CREATED),
    ("Kill", CREATED), ("Kill", RUNNING), ("Kill", PAUSED),
    ("Pause", RUNNING), ("Resume", PAUSED),
    ("ResizePty", CREATED), ("ResizePty", RUNNING), ("ResizePty", PAUSED),
    ("Update", CREATED), ("Update", RUNNING), ("Update", PAUSED),
}
# An exec process (created by Exec, running after Start, stopped once it exited).
EXEC_REFUSED: dict[tuple[str, ProcessState], Code] = {
    ("Start", RUNNING): FP, ("Start", STOPPED): FP,
    ("Kill", STOPPED): NF,
    ("Delete", RUNNING): FP,
    ("ResizePty", STOPPED): FP,
}
EXEC_NEEDS_VM: set[tuple[str, ProcessState]] = {
    ("Start", CREATED), ("Kill", RUNNING), ("ResizePty", CREATED), ("ResizePty", RUNNING),
}
# Not asserted here, where the runc shim answers otherwise: Exec in a created container,
# ResizePty of a stopped init, CloseIO of a stopped process (all accepted by runc), and Kill
# of an exec never started (runc: FAILED_PRECONDITION "process not created").


class Events:
    """What the service publishes to containerd, in order."""

    def __init__(self) -> None:
        self.published: list[tuple[str, Message]] = []

    def publish(self, topic: str, event: Message) -> None:
        self.published.append((topic, event))

    @property
    def topics(self) -> list[str]:
        return [topic for topic, _ in self.published]


def process(exec_id: str, state: ProcessState) -> Process:
    """A process in `state` the way the service gets it there: a stopped one has exited,
    so its Wait is released."""
    proc = Process(CID, exec_id=exec_id, pid=PID,
                   state=RUNNING if state is STOPPED else state)
    if state is STOPPED:
        proc.set_exited(EXIT, EXITED_AT)
    return proc


def pod(init: ProcessState, exec_state: ProcessState | None = None) -> tuple[TaskService, Events]:
    """A VM-less service holding container CID (init in `init`) and, when asked, its
    exec EID in `exec_state`."""
    events = Events()
    svc = TaskService("test", publisher=events, shutdown=lambda: None)  # type: ignore[arg-type]
    container = Container(CID, f"/run/bundles/{CID}", process("", init))
    if exec_state is not None:
        container.execs[EID] = process(EID, exec_state)
    svc.containers[CID] = container
    return svc, events


def pod_for(exec_id: str, state: ProcessState) -> tuple[TaskService, Events]:
    """The init in `state`, or (exec_id given) a running container whose exec is."""
    return pod(RUNNING, state) if exec_id else pod(state)


async def observe(svc: TaskService) -> dict[str, api.StateResponse | Code]:
    """Everything State says about the processes these tests name (or its error code)."""
    seen: dict[str, api.StateResponse | Code] = {}
    for exec_id in ("", EID, NEW_EID):
        try:
            seen[exec_id] = await svc.State(api.StateRequest(id=CID, exec_id=exec_id), CTX)
        except TtrpcError as exc:
            seen[exec_id] = exc.code
    return seen


async def settle(task: asyncio.Task) -> None:
    """Let the event loop run `task` as far as it can go without time passing."""
    for _ in range(10):
        if task.done():
            return
        await asyncio.sleep(0)


async def error_of(svc: TaskService, rpc: str, exec_id: str) -> TtrpcError:
    """The error `rpc` on process `exec_id` of CID answers (it must answer one)."""
    with pytest.raises(TtrpcError) as err:
        await CALLS[rpc](svc, CID, exec_id)
    return err.value


async def no_vm(svc: TaskService) -> tuple[Code, str]:
    """What a call answers that only needs the guest agent (Pids: no state involved)."""
    with pytest.raises(TtrpcError) as err:
        await svc.Pids(api.PidsRequest(id=CID), CTX)
    return err.value.code, err.value.message


def _call(case: tuple[str, ProcessState]) -> str:
    """Test id of an (rpc, state) case."""
    return f"{case[0]}-{case[1].name}"


def _id(case: tuple[str, ProcessState]) -> str:
    """Test id of an (exec id, state) case."""
    return f"{'exec' if case[0] else 'init'}-{case[1].name}"


# (exec id, state): the init in each of its states, an exec in each of its own (an exec
# is never paused itself: Pause acts on the container).
LIVE = [("", CREATED), ("", RUNNING), ("", PAUSED), (EID, CREATED), (EID, RUNNING)]
EVERY = LIVE + [("", STOPPED), (EID, STOPPED)]


# --- refused calls ------------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(INIT_REFUSED, key=_call), ids=_call)
async def test_init_call_refused_in_state(case: tuple[str, ProcessState]) -> None:
    """containerd sees the code it acts on, a message naming the container and why, and
    the task exactly as it was."""
    rpc, state = case
    svc, events = pod(state)
    before = await observe(svc)
    err = await error_of(svc, rpc, "")
    assert err.code == INIT_REFUSED[case], err
    assert CID in err.message
    assert (state.name if err.code == FP else "finished") in err.message, err.message
    assert await observe(svc) == before
    assert events.published == []


@pytest.mark.parametrize("case", sorted(EXEC_REFUSED, key=_call), ids=_call)
async def test_exec_call_refused_in_state(case: tuple[str, ProcessState]) -> None:
    """The same for an exec: the message names the exec and its container."""
    rpc, state = case
    svc, events = pod(RUNNING, state)
    before = await observe(svc)
    err = await error_of(svc, rpc, EID)
    assert err.code == EXEC_REFUSED[case], err
    assert CID in err.message and EID in err.message
    assert (state.name if err.code == FP else "finished") in err.message, err.message
    assert await observe(svc) == before
    assert events.published == []


@pytest.mark.parametrize("rpc", sorted(CALLS))
async def test_unknown_container_is_not_found(rpc: str) -> None:
    """containerd relies on NOT_FOUND for a task the shim does not have."""
    svc, events = pod(RUNNING)
    with pytest.raises(TtrpcError) as err:
        await CALLS[rpc](svc, "ctr-gone", "")
    assert err.value.code == NF and "ctr-gone" in err.value.message
    assert events.published == []


@pytest.mark.parametrize("rpc", PER_PROCESS)
async def test_unknown_exec_is_not_found(rpc: str) -> None:
    svc, events = pod(RUNNING, RUNNING)
    before = await observe(svc)
    err = await error_of(svc, rpc, "exec-gone")
    assert err.code == NF and "exec-gone" in err.message and CID in err.message
    assert await observe(svc) == before
    assert events.published == []


# --- legal calls --------------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(INIT_NEEDS_VM, key=_call), ids=_call)
async def test_init_call_legal_in_state_goes_to_the_vm(case: tuple[str, ProcessState]) -> None:
    """The state lets the call through: with no VM behind the service it answers what
    any call needing the guest agent answers (as Pids does), and nothing changes."""
    rpc, state = case
    svc, events = pod(state)
    before = await observe(svc)
    err = await error_of(svc, rpc, "")
    assert (err.code, err.message) == await no_vm(svc), err
    assert await observe(svc) == before
    assert events.published == []


@pytest.mark.parametrize("case", sorted(EXEC_NEEDS_VM, key=_call), ids=_call)
async def test_exec_call_legal_in_state_goes_to_the_vm(case: tuple[str, ProcessState]) -> None:
    rpc, state = case
    svc, events = pod(RUNNING, state)
    before = await observe(svc)
    err = await error_of(svc, rpc, EID)
    assert (err.code, err.message) == await no_vm(svc), err
    assert await observe(svc) == before
    assert events.published == []


@pytest.mark.parametrize("case", EVERY, ids=_id)
async def test_state_reports_the_status(case: tuple[str, ProcessState]) -> None:
    """State answers in every state with containerd's Status number; a stopped process
    also with its exit status and time."""
    exec_id, state = case
    svc, _ = pod_for(exec_id, state)
    resp = await svc.State(api.StateRequest(id=CID, exec_id=exec_id), CTX)
    assert (resp.id, resp.exec_id, resp.status) == (CID, exec_id, STATUS[state])
    assert resp.bundle == f"/run/bundles/{CID}"
    if not exec_id or state is not CREATED:  # an exec has no pid of its own before Start
        assert resp.pid == PID
    if state is STOPPED:
        assert (resp.exit_status, resp.exited_at.ToNanoseconds()) == (EXIT, EXITED_AT)
    else:
        assert resp.exit_status == 0


@pytest.mark.parametrize("exec_id", ["", EID])
async def test_wait_on_a_stopped_process_returns_its_exit(exec_id: str) -> None:
    svc, events = pod_for(exec_id, STOPPED)
    resp = await svc.Wait(api.WaitRequest(id=CID, exec_id=exec_id), CTX)
    assert (resp.exit_status, resp.exited_at.ToNanoseconds()) == (EXIT, EXITED_AT)
    assert events.published == []


@pytest.mark.parametrize("case", LIVE, ids=_id)
async def test_wait_on_a_live_process_returns_when_it_exits(case: tuple[str, ProcessState]) -> None:
    """Wait blocks while the process lives and answers its exit (here the VM's death,
    which ends every process of the pod); State and the exit event agree."""
    exec_id, state = case
    svc, events = pod_for(exec_id, state)
    waiter = asyncio.create_task(svc.Wait(api.WaitRequest(id=CID, exec_id=exec_id), CTX))
    await settle(waiter)
    assert not waiter.done()
    svc.vm_stopped()  # the pod's VM stopped under it: what ran there was killed
    await settle(waiter)
    assert waiter.done()
    resp = waiter.result()
    assert resp.exit_status == 137 and resp.exited_at.ToNanoseconds() > 0
    state_now = await svc.State(api.StateRequest(id=CID, exec_id=exec_id), CTX)
    assert (state_now.status, state_now.exit_status) == (STATUS[STOPPED], 137)
    exits = [e for topic, e in events.published if topic == "/tasks/exit"
             and e.id == (exec_id or CID)]
    assert len(exits) == 1
    assert (exits[0].container_id, exits[0].pid, exits[0].exit_status) == (CID, PID, 137)


async def test_delete_of_a_stopped_container_answers_its_exit_and_forgets_it() -> None:
    """Delete is legal once the init exited; afterwards the task is gone (NOT_FOUND for
    every call, so containerd's cleanup of a deleted task is idempotent)."""
    svc, events = pod(STOPPED)
    resp = await svc.Delete(api.DeleteRequest(id=CID), CTX)
    assert (resp.pid, resp.exit_status, resp.exited_at.ToNanoseconds()) == \
        (PID, EXIT, EXITED_AT)
    assert events.topics == ["/tasks/delete"]
    event = events.published[0][1]
    assert (event.container_id, event.id, event.pid, event.exit_status) == \
        (CID, CID, PID, EXIT)
    for rpc in CALLS:
        err = await error_of(svc, rpc, "")
        assert err.code == NF and CID in err.message, (rpc, err)


async def test_delete_of_a_created_container_forgets_it() -> None:
    """A container never started may be deleted (CRI does it when Start fails)."""
    svc, events = pod(CREATED)
    await svc.Delete(api.DeleteRequest(id=CID), CTX)
    assert events.topics == ["/tasks/delete"]
    for rpc in CALLS:
        err = await error_of(svc, rpc, "")
        assert err.code == NF and CID in err.message, (rpc, err)


@pytest.mark.parametrize("state", [CREATED, STOPPED], ids=lambda s: s.name)
async def test_delete_of_an_exec_forgets_only_it(state: ProcessState) -> None:
    """An exec not started, or finished, may be deleted: then it is unknown, its
    container untouched, and (as with runc) no delete event is sent for an exec."""
    svc, events = pod(RUNNING, state)
    before = await observe(svc)
    resp = await svc.Delete(api.DeleteRequest(id=CID, exec_id=EID), CTX)
    if state is STOPPED:
        assert (resp.exit_status, resp.exited_at.ToNanoseconds()) == (EXIT, EXITED_AT)
    after = await observe(svc)
    assert after[EID] == NF and after[""] == before[""]
    for rpc in PER_PROCESS:
        err = await error_of(svc, rpc, EID)
        assert err.code == NF and EID in err.message, (rpc, err)
    assert events.published == []


async def test_exec_in_a_running_container_adds_a_created_process() -> None:
    """Exec only records the process (Start runs it): it is then known as created, and
    a second Exec of the same id is ALREADY_EXISTS."""
    svc, events = pod(RUNNING)
    await svc.Exec(api.ExecProcessRequest(id=CID, exec_id=NEW_EID, spec=PROCESS_SPEC), CTX)
    resp = await svc.State(api.StateRequest(id=CID, exec_id=NEW_EID), CTX)
    assert (resp.exec_id, resp.status) == (NEW_EID, STATUS[CREATED])
    assert events.topics == ["/tasks/exec-added"]
    assert (events.published[0][1].container_id, events.published[0][1].exec_id) == \
        (CID, NEW_EID)
    init = await svc.State(api.StateRequest(id=CID), CTX)
    assert init.status == STATUS[RUNNING]
    err = await error_of(svc, "Exec", "")
    assert err.code == Code.ALREADY_EXISTS and NEW_EID in err.message


@pytest.mark.parametrize("case", LIVE, ids=_id)
async def test_closeio_of_a_live_process_is_accepted(case: tuple[str, ProcessState]) -> None:
    """Closing stdin of a process without one open is a no-op, not an error."""
    exec_id, state = case
    svc, events = pod_for(exec_id, state)
    before = await observe(svc)
    await svc.CloseIO(api.CloseIORequest(id=CID, exec_id=exec_id, stdin=True), CTX)
    assert await observe(svc) == before
    assert events.published == []
