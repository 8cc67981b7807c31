"""Task service rules that do not need a VM: lookups, state checks, Shutdown, what an
exec's Delete asks of the guest agent (a stand-in here)."""
from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest

from podvm_core.pb.containerd.task.v2 import shim_pb2 as api
from podvm_core.ttrpc import Code, Context, TtrpcError
from podvm_core.procstate import DELETED, RUNNING, STOPPED, ProcessState
from shim.api.task.process import Container, Process, status_of
from shim.api.task import service as service_module
from shim.api.task.service import TaskService

CTX = Context("containerd.task.v2.Task", "x")


class Recorder:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1


@pytest.fixture
def service() -> tuple[TaskService, Recorder]:
    shutdown = Recorder()
    return TaskService("test", publisher=None, shutdown=shutdown), shutdown  # type: ignore[arg-type]


def add(service: TaskService, cid: str, state: ProcessState, **execs: ProcessState) -> Container:
    c = Container(cid, f"/b/{cid}", Process(cid, pid=10, state=state))
    c.execs = {e: Process(cid, exec_id=e, state=s) for e, s in execs.items()}
    service.containers[cid] = c
    return c


async def test_shutdown_waits_for_the_last_task(service) -> None:
    svc, shutdown = service
    add(svc, "c1", RUNNING)
    await svc.Shutdown(api.ShutdownRequest(id="c1"), CTX)
    assert shutdown.calls == 0
    await svc.Shutdown(api.ShutdownRequest(id="c1", now=True), CTX)
    assert shutdown.calls == 1
    svc.containers.clear()
    await svc.Shutdown(api.ShutdownRequest(id="c1"), CTX)
    assert shutdown.calls == 2


async def test_state_reports_the_process(service) -> None:
    svc, _ = service
    c = add(svc, "c1", RUNNING, e1=STOPPED)
    c.execs["e1"].exit_status, c.execs["e1"].exited_at_ns = 3, 5_000_000_001
    init = await svc.State(api.StateRequest(id="c1"), CTX)
    assert (init.status, init.pid, init.bundle) == (2, 10, "/b/c1")
    e = await svc.State(api.StateRequest(id="c1", exec_id="e1"), CTX)
    assert (e.status, e.exit_status, e.exited_at.seconds, e.exec_id) == (3, 3, 5, "e1")
    with pytest.raises(TtrpcError) as err:
        await svc.State(api.StateRequest(id="c1", exec_id="nope"), CTX)
    assert err.value.code == Code.NOT_FOUND
    assert (await svc.Connect(api.ConnectRequest(id="c1"), CTX)).task_pid == 10


async def test_delete_of_a_stopped_process_removes_it(service) -> None:
    svc, _ = service
    c = add(svc, "c1", STOPPED, e1=STOPPED, e2=RUNNING)
    c.init.exit_status = 7
    with pytest.raises(TtrpcError) as err:
        await svc.Delete(api.DeleteRequest(id="c1", exec_id="e2"), CTX)
    assert err.value.code == Code.FAILED_PRECONDITION and "running" in err.value.message
    await svc.Delete(api.DeleteRequest(id="c1", exec_id="e1"), CTX)
    assert set(c.execs) == {"e2"}
    resp = await svc.Delete(api.DeleteRequest(id="c1"), CTX)
    assert resp.exit_status == 7 and "c1" not in svc.containers
    with pytest.raises(TtrpcError) as err:
        await svc.Delete(api.DeleteRequest(id="c1"), CTX)
    assert err.value.code == Code.NOT_FOUND


async def test_illegal_operations_answer_before_touching_the_vm(service) -> None:
    svc, _ = service
    add(svc, "stopped", STOPPED, e1=RUNNING)
    add(svc, "running", RUNNING, e1=RUNNING)
    cases = [
        (svc.Start, api.StartRequest(id="running"), Code.FAILED_PRECONDITION),
        (svc.Kill, api.KillRequest(id="stopped", signal=9), Code.NOT_FOUND),
        (svc.Exec, api.ExecProcessRequest(id="stopped", exec_id="e9"), Code.FAILED_PRECONDITION),
        (svc.Exec, api.ExecProcessRequest(id="running", exec_id="e1"), Code.ALREADY_EXISTS),
        (svc.Resume, api.ResumeRequest(id="running"), Code.FAILED_PRECONDITION),
        (svc.Pause, api.PauseRequest(id="stopped"), Code.FAILED_PRECONDITION),
        (svc.Update, api.UpdateTaskRequest(id="stopped"), Code.FAILED_PRECONDITION),
        (svc.Start, api.StartRequest(id="nope"), Code.NOT_FOUND),
        # legal, but this service has no VM behind it
        (svc.Kill, api.KillRequest(id="running", signal=15), Code.FAILED_PRECONDITION),
        (svc.Exec, api.ExecProcessRequest(id="running", exec_id="e2"), Code.INVALID_ARGUMENT),
    ]
    for handler, request, code in cases:
        with pytest.raises(TtrpcError) as err:
            await handler(request, CTX)
        assert err.value.code == code, (handler.__name__, request, err.value)


class GuestAgent:
    """Stands in for the pod's agent: records what the shim asks it to forget, answers
    with `error` when given one."""

    def __init__(self, error: TtrpcError | None = None) -> None:
        self.forgotten: list[tuple[str, str]] = []
        self.error = error

    async def remove_process(self, container_id: str, exec_id: str) -> None:
        self.forgotten.append((container_id, exec_id))
        if self.error is not None:
            raise self.error


class CopiedIO:
    """A started process's stdio copy."""

    closed = False

    async def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize("answer", [None, TtrpcError(Code.NOT_FOUND, "exec e1 not found"),
                                    TtrpcError(Code.UNAVAILABLE, "the guest agent is gone")],
                         ids=["forgotten", "not-found", "vm-gone"])
async def test_delete_of_a_started_exec_makes_the_guest_forget_it(service, answer, caplog) -> None:
    """Whatever the guest answers, the exec's Delete succeeds and frees its id; only an
    answer other than NOT_FOUND (the guest forgot it already) is worth a warning."""
    svc, _ = service
    agent = GuestAgent(answer)
    svc.slot.pod = SimpleNamespace(  # type: ignore[assignment]
        containers=SimpleNamespace(forget_exec=agent.remove_process))
    c = add(svc, "c1", RUNNING, e1=STOPPED, e2=STOPPED)
    io = c.execs["e1"].io = CopiedIO()
    c.execs["e1"].exit_status = 3
    with caplog.at_level(logging.WARNING, "podvm.task"):
        resp = await svc.Delete(api.DeleteRequest(id="c1", exec_id="e1"), CTX)
    assert resp.exit_status == 3 and io.closed and set(c.execs) == {"e2"}
    assert agent.forgotten == [("c1", "e1")]
    warned = [r.getMessage() for r in caplog.records]
    if answer is not None and answer.code == Code.UNAVAILABLE:
        assert any("e1" in m and "gone" in m for m in warned), warned
    else:
        assert warned == []
    await svc.Delete(api.DeleteRequest(id="c1", exec_id="e2"), CTX)  # never started
    assert agent.forgotten == [("c1", "e1")] and c.execs == {}


async def test_delete_of_a_started_exec_without_a_vm_succeeds(service) -> None:
    svc, _ = service
    c = add(svc, "c1", RUNNING, e1=STOPPED)
    c.execs["e1"].io = CopiedIO()
    await svc.Delete(api.DeleteRequest(id="c1", exec_id="e1"), CTX)
    assert c.execs == {}


class SlowPod:
    """A pod whose teardown takes a while (a loaded node stopping a VM)."""

    def __init__(self, seconds: float) -> None:
        self.id, self.seconds = "c1", seconds
        self.removed: list[str] = []

    async def remove_container(self, container_id: str, owns_vm: bool) -> None:
        await asyncio.sleep(self.seconds)
        self.removed.append(container_id)


async def test_a_delete_past_containerd_s_deadline_still_removes_the_pod_whole(
        service, monkeypatch) -> None:
    """The ttrpc server cancels a handler at the caller's deadline; the pod's teardown,
    once begun, goes on to its end (else its VM would run on with nothing to stop it),
    and a shim left with no container exits by itself if no Shutdown comes."""
    monkeypatch.setattr(service_module, "IDLE_EXIT", 0.3)
    svc, shutdown = service
    add(svc, "c1", STOPPED)
    pod = svc.slot.pod = SlowPod(0.2)  # type: ignore[assignment]
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05):
            await svc.Delete(api.DeleteRequest(id="c1"), CTX)
    assert pod.removed == []
    # Until removed it is there, deleted, and the shim stays: containerd 1.6's
    # StopPodSandbox takes a sandbox container it cannot find for one already stopped.
    state = await svc.State(api.StateRequest(id="c1"), CTX)
    assert state.status == status_of(DELETED)
    await svc.Shutdown(api.ShutdownRequest(id="c1"), CTX)
    assert shutdown.calls == 0
    await asyncio.sleep(0.3)
    assert pod.removed == ["c1"], "the teardown stopped half way"
    assert "c1" not in svc.containers
    assert shutdown.calls == 0
    await asyncio.sleep(0.3)
    assert shutdown.calls == 1, "a shim nobody will ask to go stays forever"


async def test_a_shim_with_a_container_or_a_shutdown_to_come_does_not_exit_by_itself(
        service, monkeypatch) -> None:
    monkeypatch.setattr(service_module, "IDLE_EXIT", 0.1)
    svc, shutdown = service
    add(svc, "c1", STOPPED)
    add(svc, "c2", RUNNING)
    svc.slot.pod = SlowPod(0)  # type: ignore[assignment]
    await svc.Delete(api.DeleteRequest(id="c1"), CTX)
    await asyncio.sleep(0.3)
    assert shutdown.calls == 0 and list(svc.containers) == ["c2"]
    svc.containers.clear()
    svc.slot.sandbox_api_owner = "sandbox-1"  # its ShutdownSandbox ends it
    done = asyncio.get_running_loop().create_future()
    done.set_result(None)
    svc._removed(done)  # as the end of a removal would
    await asyncio.sleep(0.3)
    assert shutdown.calls == 0
