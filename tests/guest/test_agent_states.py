"""The guest agent keeps its processes in the shim's states (podvm_core.procstate) and
serves one operation at a time per process: its handlers, with runc replaced by a
recorder (the real runc is for the VM tests), answer illegal calls with the shim's codes
and let exactly one of two concurrent calls act."""
from __future__ import annotations

import asyncio

import pytest

from guest.agent import runc
from guest.agent.containers import Container, Process
from guest.agent.service import AgentService
from podvm_core.pb.agent import agent_pb2 as pb
from podvm_core.procstate import CREATED, DELETED, PAUSED, RUNNING, STOPPED, ProcessState
from podvm_core.ttrpc import Code, Context, TtrpcError

CTX = Context("podvm.agent.v1.Agent", "x")
CID = "agent-state-test"
FP, NF = Code.FAILED_PRECONDITION, Code.NOT_FOUND


class Runc:
    """Stands in for runc: records each call; `kill` makes the init exit, as it would."""

    def __init__(self, agent: AgentService) -> None:
        self.agent = agent
        self.calls: list[tuple[str, ...]] = []

    async def __call__(self, container_id: str, *args: str, **_: object) -> bytes:
        self.calls.append(args)
        await asyncio.sleep(0.01)  # a call takes time: others arrive meanwhile
        container = self.agent.containers.get(container_id)
        if args[0] == "kill" and container is not None:
            if not container.init.state.live:
                raise TtrpcError(FP, f"runc kill {container_id}: container not running")
            container.init.set_exited(137, 1)
        return b""

    def ran(self, command: str) -> int:
        return sum(1 for args in self.calls if args[0] == command)


@pytest.fixture
def agent(monkeypatch) -> tuple[AgentService, Runc]:
    service = AgentService()
    fake = Runc(service)
    monkeypatch.setattr(runc, "runc", fake)
    return service, fake


def add(agent: AgentService, state: ProcessState, holder: bool = False) -> Container:
    init = Process(CID, "", pid=4321, state=RUNNING if state is STOPPED else state)
    if state is STOPPED:
        init.set_exited(0, 1)
    container = Container(CID, False, init, holder=holder)
    agent.containers[CID] = container
    return container


def codes(results: list) -> list[str]:
    return sorted(r.code.name if isinstance(r, TtrpcError) else "OK" for r in results)


def start() -> pb.StartContainerRequest:
    return pb.StartContainerRequest(container_id=CID)


def signal(all_: bool = False) -> pb.SignalProcessRequest:
    return pb.SignalProcessRequest(container_id=CID, signal=9, all=all_)


def remove() -> pb.RemoveContainerRequest:
    return pb.RemoveContainerRequest(container_id=CID)


async def test_concurrent_starts_start_once(agent) -> None:
    svc, fake = agent
    container = add(svc, CREATED)
    results = await asyncio.gather(svc.StartContainer(start(), CTX),
                                   svc.StartContainer(start(), CTX), return_exceptions=True)
    assert codes(results) == ["FAILED_PRECONDITION", "OK"], results
    refusal = next(r for r in results if isinstance(r, TtrpcError))
    assert CID in refusal.message and "running" in refusal.message
    assert fake.ran("start") == 1
    assert container.init.state is RUNNING


async def test_a_holder_is_started_without_runc(agent) -> None:
    svc, fake = agent
    container = add(svc, CREATED, holder=True)
    await svc.StartContainer(start(), CTX)
    assert container.init.state is RUNNING and fake.calls == []
    with pytest.raises(TtrpcError) as err:
        await svc.StartContainer(start(), CTX)
    assert err.value.code == FP


async def test_signal_to_a_finished_process_is_not_found(agent) -> None:
    svc, fake = agent
    add(svc, STOPPED)
    with pytest.raises(TtrpcError) as err:
        await svc.SignalProcess(signal(), CTX)
    assert err.value.code == NF and "process already finished" in err.value.message
    assert fake.calls == []


async def test_kill_all_reaches_a_stopped_containers_leftovers(agent) -> None:
    svc, fake = agent
    add(svc, STOPPED)
    with pytest.raises(TtrpcError) as err:  # runc: nothing left to signal
        await svc.SignalProcess(signal(all_=True), CTX)
    assert err.value.code == NF and "process already finished" in err.value.message
    assert fake.calls == [("kill", "--all", CID, "9")]


async def test_remove_of_a_running_container_is_refused(agent) -> None:
    svc, fake = agent
    container = add(svc, RUNNING)
    with pytest.raises(TtrpcError) as err:
        await svc.RemoveContainer(remove(), CTX)
    assert err.value.code == FP and "running" in err.value.message
    assert fake.calls == [] and svc.containers[CID] is container
    assert container.init.state is RUNNING


@pytest.mark.parametrize("state", [CREATED, STOPPED], ids=lambda s: s.name)
async def test_concurrent_removes_remove_once(agent, state: ProcessState) -> None:
    svc, fake = agent
    container = add(svc, state)
    results = await asyncio.gather(svc.RemoveContainer(remove(), CTX),
                                   svc.RemoveContainer(remove(), CTX), return_exceptions=True)
    assert codes(results) == ["NOT_FOUND", "OK"], results
    assert fake.ran("delete") == 1
    assert container.init.state is DELETED and CID not in svc.containers


async def test_kill_beside_remove(agent) -> None:
    """A Kill that holds the process first makes it exit, and the Remove waiting behind
    it then finds it stopped; a Remove first leaves the Kill NOT_FOUND."""
    svc, fake = agent
    container = add(svc, RUNNING)
    results = await asyncio.gather(svc.SignalProcess(signal(), CTX),
                                   svc.RemoveContainer(remove(), CTX), return_exceptions=True)
    assert codes(results) == ["OK", "OK"], results
    assert container.init.state is DELETED and container.init.exit_status == 137

    container = add(svc, STOPPED)
    removed, killed = await asyncio.gather(svc.RemoveContainer(remove(), CTX),
                                           svc.SignalProcess(signal(), CTX),
                                           return_exceptions=True)
    assert removed is not None and not isinstance(removed, BaseException)
    assert isinstance(killed, TtrpcError) and killed.code == NF, killed
    assert container.init.state is DELETED


async def test_pause_and_exec_follow_the_init(agent) -> None:
    svc, fake = agent
    container = add(svc, RUNNING)
    pause = pb.PauseContainerRequest(container_id=CID)
    await svc.PauseContainer(pause, CTX)
    assert container.init.state is PAUSED
    with pytest.raises(TtrpcError) as err:
        await svc.PauseContainer(pause, CTX)
    assert err.value.code == FP
    exec_req = pb.ExecProcessRequest(container_id=CID, exec_id="e1", process_json=b"{}")
    with pytest.raises(TtrpcError) as err:
        await svc.ExecProcess(exec_req, CTX)
    assert err.value.code == FP and "paused" in err.value.message
    await svc.ResumeContainer(pb.ResumeContainerRequest(container_id=CID), CTX)
    assert container.init.state is RUNNING
    assert fake.calls == [("pause", CID), ("resume", CID)]
