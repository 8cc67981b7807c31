"""Task service rules that do not need a VM: lookups, state checks, Shutdown."""
from __future__ import annotations

import pytest

from podvm_core.pb.containerd.task.v2 import shim_pb2 as api
from podvm_core.ttrpc import Code, Context, TtrpcError
from podvm_core.procstate import RUNNING, STOPPED, ProcessState
from shim.task.process import Container, Process
from shim.task.service import TaskService

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
