"""The guest agent keeps its processes in the shim's states (podvm_core.procstate) and
serves one operation at a time per process: its handlers, with runc replaced by a
recorder (the real runc is for the VM tests), answer illegal calls with the shim's codes
and let exactly one of two concurrent calls act. An exec is kept until the shim deletes
it (RemoveProcess), then forgotten with its stdio, so that exec probes run for the
life of a container leave nothing behind."""
from __future__ import annotations

import asyncio
import itertools
import pathlib

import pytest

from guest.agent import kill, runc
from guest.agent.containers import Container, Process
from guest.agent.reaper import REAPER
from guest.agent.service import AgentService
from podvm_core.pb.agent import agent_pb2 as pb
from podvm_core.procstate import CREATED, DELETED, PAUSED, RUNNING, STOPPED, ProcessState
from podvm_core.ttrpc import Code, Context, TtrpcError

CTX = Context("podvm.agent.v1.Agent", "x")
CID = "agent-state-test"
FP, NF = Code.FAILED_PRECONDITION, Code.NOT_FOUND
PIDS = itertools.count(70001)
"""Guest pids of fake execs, never one twice in a run: the reaper is the agent's one."""


class Runc:
    """Stands in for runc: records each call; `kill` makes the init exit, as it would."""

    def __init__(self, agent: AgentService) -> None:
        self.agent = agent
        self.calls: list[tuple[str, ...]] = []

    async def __call__(self, container_id: str, *args: str, **_: object) -> bytes:
        self.calls.append(args)
        await asyncio.sleep(0.01)  # a call takes time: others arrive meanwhile
        container = self.agent.containers.get(container_id)
        if args[0] == "exec":  # as runc exec --detach: the pid in the pid file
            pathlib.Path(args[args.index("--pid-file") + 1]).write_text(f"{next(PIDS)}\n")
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

    async def signal_container(container_id: str, pid: int, signum: int, every: bool):
        """guest/agent/kill.py (tests/guest/test_kill.py), its kill played by the fake."""
        await fake(container_id, "kill", *(["--all"] if every else []), container_id,
                   str(signum))

    async def remove_exited(container_id: str) -> bool:
        """guest/agent/kill.py's removal without runc, played by the fake's delete."""
        await fake(container_id, "delete", "--force", container_id)
        return True

    monkeypatch.setattr(kill, "signal_container", signal_container)
    monkeypatch.setattr(kill, "remove_exited", remove_exited)
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


@pytest.fixture
def execs(agent, tmp_path, monkeypatch) -> tuple[AgentService, Runc, Container]:
    """A running container that execs go into, its bundle in a directory of the test's."""
    monkeypatch.setattr(runc, "bundle_dir", lambda container_id: str(tmp_path))
    svc, fake = agent
    return svc, fake, add(svc, RUNNING)


def exec_request(exec_id: str = "probe") -> pb.ExecProcessRequest:
    return pb.ExecProcessRequest(container_id=CID, exec_id=exec_id,
                                 process_json=b'{"args": ["true"], "cwd": "/"}',
                                 stdio=pb.Stdio(stdout=True, stderr=True))


def forget(exec_id: str = "probe", container_id: str = CID) -> pb.RemoveProcessRequest:
    return pb.RemoveProcessRequest(container_id=container_id, exec_id=exec_id)


async def exited(proc: Process, status: int = 0) -> None:
    """The reaper saw `proc` exit, as PID 1 does."""
    REAPER.watch(proc.pid).set_result(status)
    await asyncio.sleep(0)
    assert proc.state is STOPPED


async def test_an_exited_exec_is_forgotten_with_its_stdio(execs) -> None:
    svc, fake, container = execs
    await svc.ExecProcess(exec_request(), CTX)
    proc = container.execs["probe"]
    streams = [proc.stdout, proc.stderr]
    assert all(s is not None and s.fd >= 0 for s in streams)
    await exited(proc, 3)
    assert (await svc.WaitProcess(pb.WaitProcessRequest(container_id=CID, exec_id="probe"),
                                  CTX)).exit_status == 3
    await svc.RemoveProcess(forget(), CTX)
    assert container.execs == {} and proc.state is DELETED
    assert [s.fd for s in streams] == [-1, -1]  # type: ignore[union-attr]
    for call in (svc.WaitProcess(pb.WaitProcessRequest(container_id=CID, exec_id="probe"), CTX),
                 svc.ReadStdout(pb.ReadStreamRequest(container_id=CID, exec_id="probe"), CTX),
                 svc.RemoveProcess(forget(), CTX)):
        with pytest.raises(TtrpcError) as err:
            await call
        assert err.value.code == NF and "probe" in err.value.message
    assert svc.containers[CID] is container and container.init.state is RUNNING


async def test_a_running_exec_is_not_forgotten(execs) -> None:
    svc, fake, container = execs
    await svc.ExecProcess(exec_request(), CTX)
    proc = container.execs["probe"]
    with pytest.raises(TtrpcError) as err:
        await svc.RemoveProcess(forget(), CTX)
    assert err.value.code == FP and "probe" in err.value.message \
        and "running" in err.value.message
    assert container.execs == {"probe": proc} and proc.state is RUNNING
    assert proc.stdout is not None and proc.stdout.fd >= 0
    await exited(proc)
    await svc.RemoveProcess(forget(), CTX)
    assert container.execs == {}


async def test_forgetting_what_the_guest_does_not_hold_is_not_found(execs) -> None:
    """The shim takes NOT_FOUND as done: a repeated or late forget changes nothing."""
    svc, fake, container = execs
    for request in (forget("never-ran"), forget(container_id="no-such-container")):
        with pytest.raises(TtrpcError) as err:
            await svc.RemoveProcess(request, CTX)
        assert err.value.code == NF
    with pytest.raises(TtrpcError) as err:  # a container's init goes with RemoveContainer
        await svc.RemoveProcess(forget(""), CTX)
    assert err.value.code == Code.INVALID_ARGUMENT
    assert container.init.state is RUNNING

    await svc.ExecProcess(exec_request(), CTX)
    await exited(container.execs["probe"])
    results = await asyncio.gather(svc.RemoveProcess(forget(), CTX),
                                   svc.RemoveProcess(forget(), CTX), return_exceptions=True)
    assert codes(results) == ["NOT_FOUND", "OK"], results
    assert container.execs == {}


async def test_an_exec_id_is_reused_once_forgotten(execs) -> None:
    """kubelet's ExecSync, round after round: exec, exit, delete. The id is taken until
    the exec is forgotten, and nothing of the rounds stays behind."""
    svc, fake, container = execs
    pids = set()
    for _ in range(30):
        pid = (await svc.ExecProcess(exec_request(), CTX)).pid
        with pytest.raises(TtrpcError) as err:
            await svc.ExecProcess(exec_request(), CTX)
        assert err.value.code == Code.ALREADY_EXISTS
        await exited(container.execs["probe"])
        await svc.RemoveProcess(forget(), CTX)
        pids.add(pid)
    assert len(pids) == 30 and fake.ran("exec") == 30
    assert container.execs == {}
