"""The guest attacks the host through the agent channel (guest root: tests/api/task/
hostileagent.py plays it on a real ttrpc connection). What must hold:
(a) a call it never answers fails with DEADLINE_EXCEEDED within its bound, naming the
    call and the sandbox, while the connection's other calls are answered; the long polls
    go on in bounded windows and a guest cannot make them spin; a guest that stops
    reading cannot grow the shim's memory;
(b) OOM kills and exits it names for containers not of this pod are never published;
(c) an OOM flood reaches containerd at a bounded rate through a bounded queue;
(d) stats that are not containerd's cgroup v2 Metrics, or too large, are an error and
    never forwarded."""
from __future__ import annotations

import asyncio
import inspect
import time
import tracemalloc
from types import SimpleNamespace

import pytest

from podvm_core.pb.agent import agent_pb2 as pb
from podvm_core.pb.containerd.cgroups.v2 import metrics_pb2 as m
from podvm_core.pb.containerd.events import task_pb2 as events
from podvm_core.pb.containerd.task.v2 import shim_pb2 as api
from podvm_core.procstate import RUNNING
from podvm_core.ttrpc import Code, Context, TtrpcError, framing
from google.protobuf.any_pb2 import Any
from shim.vm import agent as agent_module
from shim.api import events as events_module
from shim.vm.agent import Agent
from shim.api.events import Publisher
from shim.pod import guestevents
from shim.pod.guestevents import oom_bucket, watch_oom
from shim.vm.stdio import Stdio
from shim.api.task.process import Container, Process
from shim.api.task.service import TaskService

from tests.api.task.hostileagent import NEVER, HostileAgent, always, status

CTX = Context("containerd.task.v2.Task", "x")
STDIO = Stdio(False, True, True, False)
BOUND = 0.3
"""Every deadline, shortened for the tests (shim/vm/agent.py's constants)."""
LATE = BOUND + 1.0 + 0.7
"""The latest a call may fail: its bound, the client's grace, and a loaded machine's slack."""

CALLS = {  # every call of the typed client with a deadline: the RPC it makes
    "ping": ("Ping", lambda a: a.ping(timeout=BOUND)),
    "resume_restored": ("Resume", lambda a: a.resume_restored({}, timeout=BOUND)),
    "create_container": ("CreateContainer",
                         lambda a: a.create_container("c1", b"{}", STDIO, sandbox=False)),
    "start_container": ("StartContainer", lambda a: a.start_container("c1")),
    "exec_process": ("ExecProcess", lambda a: a.exec_process("c1", "e1", b"{}", STDIO)),
    "signal": ("SignalProcess", lambda a: a.signal("c1", "", 9, True)),
    "pids": ("ListPids", lambda a: a.pids("c1")),
    "stats": ("ContainerStats", lambda a: a.stats("c1")),
    "update": ("UpdateContainer", lambda a: a.update("c1", b"{}")),
    "pause": ("PauseContainer", lambda a: a.pause("c1")),
    "resume": ("ResumeContainer", lambda a: a.resume("c1")),
    "remove": ("RemoveContainer", lambda a: a.remove("c1")),
    "remove_process": ("RemoveProcess", lambda a: a.remove_process("c1", "e1", BOUND)),
    "write_stdin": ("WriteStdin", lambda a: a.write_stdin("c1", "", b"x")),
    "close_stdin": ("CloseStdin", lambda a: a.close_stdin("c1", "")),
    "resize": ("ResizeTty", lambda a: a.resize("c1", "", 80, 24)),
    "open_port_forward": ("OpenPortForward", lambda a: a.open_port_forward(80)),
    "write_port_forward": ("WritePortForward", lambda a: a.write_port_forward(1, b"x")),
    "close_port_forward": ("ClosePortForward", lambda a: a.close_port_forward(1)),
    "online": ("OnlineCPUMem", lambda a: a.online()),
    "grow_scratch": ("GrowScratch", lambda a: a.grow_scratch(256 << 20)),
    "create_pod_namespaces": ("CreatePodNamespaces", lambda a: a.create_pod_namespaces()),
    "configure_network": ("ConfigureNetwork", lambda a: a.configure_network(
        SimpleNamespace(interfaces=[], routes=[]), timeout=BOUND)),
    "shutdown": ("Shutdown", lambda a: a.shutdown(timeout=BOUND)),
}
POLLS = {  # the long polls: asked again window after window
    "wait": ("WaitProcess", lambda a: a.wait("c1", "")),
    "read": ("ReadStdout", lambda a: a.read("stdout", "c1", "")),
    "read_port_forward": ("ReadPortForward", lambda a: a.read_port_forward(1)),
    "oom_event": ("GetOOMEvent", lambda a: a.oom_event()),
}


@pytest.fixture(autouse=True)
def short_deadlines(monkeypatch) -> None:
    for name in ("QUICK", "RUNC", "SETUP", "GUEST", "FLOW"):
        monkeypatch.setattr(agent_module, name, BOUND)
    monkeypatch.setattr(agent_module, "POLL", 0.4)
    monkeypatch.setattr(agent_module, "POLL_GRACE", 0.3)
    monkeypatch.setattr(agent_module, "POLL_PACE", 0.5)


@pytest.fixture
async def guest():
    hostile = HostileAgent()
    yield hostile
    await hostile.close()


class Published(list):
    def publish(self, topic: str, event) -> None:
        self.append((topic, event))


def task_service(agent: Agent, *container_ids: str) -> tuple[TaskService, Published]:
    published = Published()
    svc = TaskService("test", publisher=published, shutdown=lambda: None)  # type: ignore[arg-type]
    svc.slot.pod = SimpleNamespace(containers=SimpleNamespace(  # type: ignore[assignment]
        pids=agent.pids, stats=agent.stats, wait=agent.wait))
    for cid in container_ids:
        svc.containers[cid] = Container(cid, f"/b/{cid}", Process(cid, pid=10, state=RUNNING))
    return svc, published


# --- (a) deadlines ------------------------------------------------------------------------

def test_every_call_of_the_agent_client_is_covered_here() -> None:
    """A call added to shim/vm/agent.py without a place in these tables fails here: each one
    is either bounded (CALLS) or a long poll (POLLS), and _call has no unbounded default."""
    public = {name for name, fn in inspect.getmembers(Agent, inspect.iscoroutinefunction)
              if not name.startswith("_")} - {"close"}
    assert public == set(CALLS) | set(POLLS)
    rpcs = {rpc.name for rpc in pb.DESCRIPTOR.services_by_name["Agent"].methods}
    assert rpcs - {"ReadStderr"} == {rpc for rpc, _ in (*CALLS.values(), *POLLS.values())}
    timeout = inspect.signature(Agent._call).parameters["timeout"]
    assert timeout.default is inspect.Parameter.empty


async def test_a_call_the_guest_never_answers_fails_within_its_bound(guest) -> None:
    agent = await guest.connect()

    async def one(name: str) -> tuple[str, TtrpcError, float]:
        rpc, call = CALLS[name]
        started = time.monotonic()
        with pytest.raises(TtrpcError) as err:
            await call(agent)
        return rpc, err.value, time.monotonic() - started

    results = await asyncio.gather(*(one(name) for name in CALLS))
    for rpc, error, took in results:
        assert error.code == Code.DEADLINE_EXCEEDED, (rpc, error)
        assert rpc in error.message and "sb-hostile" in error.message, error.message
        assert BOUND <= took < LATE, (rpc, took)
    assert set(guest.asked) == {rpc for rpc, _ in CALLS.values()}
    await agent.close()


async def test_a_stuck_call_holds_up_neither_containerd_nor_the_pod_s_other_calls(guest) -> None:
    guest.handlers["ListPids"] = always(pb.ListPidsResponse(
        processes=[pb.ProcessEntry(pid=7)]))
    guest.handlers["Ping"] = always(pb.PingResponse(online_cpus=3))
    agent = await guest.connect()
    svc, _ = task_service(agent, "c1")
    stats = asyncio.ensure_future(svc.Stats(api.StatsRequest(id="c1"), CTX))
    started = time.monotonic()
    for _ in range(20):  # answered one after another while Stats hangs
        assert (await svc.Pids(api.PidsRequest(id="c1"), CTX)).processes[0].pid == 7
        assert (await agent.ping()).online_cpus == 3
    assert time.monotonic() - started < BOUND and not stats.done()
    with pytest.raises(TtrpcError) as err:
        await stats
    assert err.value.code == Code.DEADLINE_EXCEEDED
    assert "ContainerStats" in err.value.message and "sb-hostile" in err.value.message
    assert time.monotonic() - started < LATE
    await agent.close()


async def test_a_long_poll_never_answered_is_asked_again_in_windows(guest) -> None:
    agent = await guest.connect()
    polls = [asyncio.ensure_future(call(agent)) for _, call in POLLS.values()]
    await asyncio.sleep(2.5)  # windows of 0.4 s + 0.3 s grace: 3 asks each
    assert not any(p.done() for p in polls)
    for rpc, _ in POLLS.values():
        assert 2 <= guest.asked[rpc] <= 4, guest.asked
    guest.handlers["WaitProcess"] = always(pb.WaitProcessResponse(exit_status=3))
    await asyncio.sleep(1.0)  # the next window gets the answer
    assert polls[0].done() and polls[0].result().exit_status == 3
    for p in polls[1:]:
        p.cancel()
    await asyncio.gather(*polls[1:], return_exceptions=True)
    await agent.close()


async def test_a_guest_ending_every_window_at_once_cannot_make_the_shim_spin(guest) -> None:
    guest.handlers["GetOOMEvent"] = always(status(Code.DEADLINE_EXCEEDED, "now"))
    agent = await guest.connect()
    poll = asyncio.ensure_future(agent.oom_event())
    await asyncio.sleep(2.0)
    assert not poll.done()
    assert 3 <= guest.asked["GetOOMEvent"] <= 5  # POLL_PACE 0.5 s: not thousands
    poll.cancel()
    await asyncio.gather(poll, return_exceptions=True)
    await agent.close()


async def test_a_guest_that_stops_reading_cannot_grow_the_shim_s_memory(guest) -> None:
    """Its requests pile up unsent only up to the client's limit: then calls are refused."""
    guest.handlers.clear()
    agent = await guest.connect()
    assert guest._server is not None
    guest._server.cancel()  # the guest reads nothing more
    data = b"x" * (3 << 20)
    codes = []
    for _ in range(6):
        started = time.monotonic()
        with pytest.raises(TtrpcError) as err:
            await agent.write_stdin("c1", "", data)
        assert time.monotonic() - started < LATE
        codes.append(err.value.code)
    assert codes[0] == Code.DEADLINE_EXCEEDED and codes[-1] == Code.RESOURCE_EXHAUSTED
    unsent = agent._client._writer.transport.get_write_buffer_size()
    assert unsent <= 2 * framing.MAX_DATA + len(data) + 1024
    await agent.close()


# --- (b) events for containers of other pods ----------------------------------------------

def oom_sequence(*ids: str):
    pending = list(ids)

    async def handler(request):
        if not pending:
            return NEVER
        return pb.OOMEvent(container_id=pending.pop(0))
    return handler


async def test_oom_kills_named_for_other_pods_containers_are_never_published(guest, caplog) -> None:
    foreign = ["victim-of-another-pod", "", "c1/../c2", "x" * 5000]
    guest.handlers["GetOOMEvent"] = oom_sequence(*foreign, "c1")
    agent = await guest.connect()
    svc, published = task_service(agent, "c1")
    watch = asyncio.ensure_future(watch_oom(agent, "sb-hostile", oom_bucket(),
                                            svc.container_oom))
    for _ in range(100):
        if published:
            break
        await asyncio.sleep(0.02)
    watch.cancel()
    await asyncio.gather(watch, return_exceptions=True)
    # The pod's own container, asked for last, is the only one that got through.
    assert [(t, e.container_id) for t, e in published] == [("/tasks/oom", "c1")]
    assert svc.report._foreign.count == len(foreign)
    warnings = [r for r in caplog.records if "no container of this pod" in r.getMessage()]
    assert len(warnings) == 1  # rate-limited: one line for the four
    assert len(warnings[0].getMessage()) < 400
    await agent.close()


async def test_an_exit_for_a_container_not_of_this_pod_is_never_published(guest) -> None:
    guest.handlers["WaitProcess"] = always(pb.WaitProcessResponse(exit_status=137,
                                                                  oom_killed=True))
    agent = await guest.connect()
    svc, published = task_service(agent, "c1")
    stranger = Process("another-pod-container", pid=10, state=RUNNING)
    svc.report.watch(stranger, svc._pod)
    own = svc.containers["c1"].init
    svc.report.watch(own, svc._pod)
    await asyncio.wait_for(own.wait(), 5)
    await asyncio.wait_for(stranger.wait(), 5)
    assert [(t, e.container_id) for t, e in published] == [("/tasks/oom", "c1"),
                                                           ("/tasks/exit", "c1")]
    await agent.close()


async def test_an_exit_time_no_real_exit_could_have_is_replaced_by_now(guest) -> None:
    answer = pb.WaitProcessResponse(exit_status=1)
    answer.exited_at.seconds = 2**62  # far beyond any clock
    guest.handlers["WaitProcess"] = always(answer)
    agent = await guest.connect()
    svc, published = task_service(agent, "c1")
    svc.report.watch(svc.containers["c1"].init, svc._pod)
    await asyncio.wait_for(svc.containers["c1"].init.wait(), 5)
    (_, exit_event), = published
    assert abs(exit_event.exited_at.ToNanoseconds() - time.time_ns()) < 10 * 10**9
    await agent.close()


# --- (c) floods ---------------------------------------------------------------------------

async def test_an_oom_flood_is_published_at_a_bounded_rate(guest, monkeypatch) -> None:
    guest.handlers["GetOOMEvent"] = always(pb.OOMEvent(container_id="c1"))
    agent = await guest.connect()
    svc, published = task_service(agent, "c1")
    watch = asyncio.ensure_future(watch_oom(agent, "sb-hostile", oom_bucket(),
                                            svc.container_oom))
    await asyncio.sleep(2.0)
    watch.cancel()
    await asyncio.gather(watch, return_exceptions=True)
    most = guestevents.OOM_BURST + guestevents.OOM_RATE * 2.0 + 1
    assert guestevents.OOM_BURST <= len(published) <= most
    assert guest.asked["GetOOMEvent"] <= most + 1  # the guest is asked no faster either
    await agent.close()


class StuckContainerd:
    """containerd's event service, taking requests and never answering."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.connections: list = []

    async def __aenter__(self) -> "StuckContainerd":
        async def hold(reader, writer) -> None:
            self.connections.append(writer)
            await reader.read()  # drained, never answered

        self._server = await asyncio.start_unix_server(hold, path=self.path)
        return self

    async def __aexit__(self, *exc: object) -> None:
        for writer in self.connections:
            writer.close()
        self._server.close()


async def test_the_publisher_queue_stays_bounded_while_containerd_takes_nothing(tmp_path) -> None:
    async with StuckContainerd(str(tmp_path / "ttrpc.sock")) as containerd:
        publisher = Publisher("test", containerd.path)
        oom = events.TaskOOM(container_id="c1")
        tracemalloc.start()
        try:
            for _ in range(events_module.MAX_QUEUED + 10):
                publisher.publish("/tasks/oom", oom)
            await asyncio.sleep(0.1)  # the worker takes one and is stuck sending it
            before, _ = tracemalloc.get_traced_memory()
            started = time.monotonic()
            for _ in range(50_000):
                publisher.publish("/tasks/oom", oom)
            publishing = time.monotonic() - started
            after, _ = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert publisher._queue.qsize() <= events_module.MAX_QUEUED
        assert publisher.dropped >= 50_000
        assert after - before < 256 << 10, after - before  # nothing kept per event dropped
        assert publishing < 5  # never blocks: each publish is a check and a count
        await publisher.close(timeout=0.1)


# --- (d) stats ----------------------------------------------------------------------------

def stats_answer(metrics: Any):
    return always(pb.ContainerStatsResponse(metrics=metrics))


def packed(metrics: m.Metrics) -> Any:
    return Any(type_url=m.Metrics.DESCRIPTOR.full_name, value=metrics.SerializeToString())


ONE_DEVICE = m.IOEntry(major=8, minor=0, rbytes=1, wbytes=2, rios=3, wios=4)
FORGED = {
    "another type": Any(type_url="io.containerd.cgroups.v1.Metrics",
                        value=m.Metrics(pids=m.PidsStat(current=1)).SerializeToString()),
    "a type URL of its own": Any(type_url="type.googleapis.com/evil.Payload", value=b"\x08\x01"),
    "bytes that do not decode": Any(type_url=m.Metrics.DESCRIPTOR.full_name,
                                    value=b"\x0a\xff\xff\xff\xff\x0f"),
    "a huge payload": packed(m.Metrics(io=m.IOStat(usage=[ONE_DEVICE] * 20_000))),
}


@pytest.mark.parametrize("what", list(FORGED))
async def test_stats_the_guest_forged_are_an_error_and_never_forwarded(guest, what) -> None:
    guest.handlers["ContainerStats"] = stats_answer(FORGED[what])
    agent = await guest.connect()
    svc, _ = task_service(agent, "c1")
    with pytest.raises(TtrpcError) as err:
        await svc.Stats(api.StatsRequest(id="c1"), CTX)
    assert err.value.code == Code.INTERNAL and "sb-hostile" in err.value.message
    assert len(err.value.message) < 500
    await agent.close()


async def test_stats_of_the_expected_type_pass_as_that_type_only(guest) -> None:
    metrics = m.Metrics(pids=m.PidsStat(current=4, limit=100),
                        memory=m.MemoryStat(usage=1 << 20))
    smuggled = metrics.SerializeToString() + b"\xfa\x3f\x05hello"  # field 1023: unknown
    guest.handlers["ContainerStats"] = stats_answer(
        Any(type_url=m.Metrics.DESCRIPTOR.full_name, value=smuggled))
    agent = await guest.connect()
    svc, _ = task_service(agent, "c1")
    answer = await svc.Stats(api.StatsRequest(id="c1"), CTX)
    assert answer.stats.type_url == m.Metrics.DESCRIPTOR.full_name
    assert answer.stats.value == metrics.SerializeToString()  # the unknown field dropped
    assert m.Metrics.FromString(answer.stats.value).pids.current == 4
    await agent.close()


async def test_a_status_of_the_guest_s_own_making_reaches_containerd_bounded(guest) -> None:
    """A code outside ttrpc's table and a megabyte of message: UNKNOWN, cut short."""
    guest.handlers["ListPids"] = always(status(99, "lies " * 200_000))  # type: ignore[arg-type]
    agent = await guest.connect()
    svc, _ = task_service(agent, "c1")
    with pytest.raises(TtrpcError) as err:
        await svc.Pids(api.PidsRequest(id="c1"), CTX)
    assert err.value.code == Code.UNKNOWN
    assert len(err.value.message) <= agent_module._MESSAGE_MAX + 3
    await agent.close()
