"""The daemon's Task API: Connect is answered before the Task service is made (containerd
connects as soon as `start` returns); every other call makes it first, once."""
from __future__ import annotations

import os

import pytest

from podvm_core.pb.containerd.task.v2 import shim_pb2 as api
from podvm_core.ttrpc import Client, Code, Server, TtrpcError
from shim import __version__
from shim.api.task.deferred import TaskAPI
from shim.contract.daemon import TASK_SERVICES
from shim.api.events import Publisher


class FakeTasks:
    """TaskService's shape: knows container "c1" (task pid 42), serves no Pids."""

    made: list[FakeTasks] = []

    def __init__(self, namespace: str, publisher: Publisher, shutdown,
                 slot=None) -> None:
        self.namespace = namespace
        self.closed = False
        FakeTasks.made.append(self)

    async def Connect(self, req: api.ConnectRequest, ctx) -> api.ConnectResponse:
        return api.ConnectResponse(shim_pid=os.getpid(), task_pid=42 if req.id == "c1" else 0,
                                   version="fake")

    async def State(self, req: api.StateRequest, ctx) -> api.StateResponse:
        if req.id != "c1":
            raise TtrpcError(Code.NOT_FOUND, f"container {req.id!r} not found")
        return api.StateResponse(id=req.id, pid=42)

    async def close(self) -> None:
        self.closed = True


@pytest.fixture
async def served(tmp_path, monkeypatch):
    monkeypatch.setattr("shim.api.task.service.TaskService", FakeTasks)
    FakeTasks.made = []
    publisher = Publisher("podvm-test")
    tasks = TaskAPI("podvm-test", publisher, shutdown=lambda: None)
    descriptor = api.DESCRIPTOR.services_by_name["Task"]
    server = Server([tasks.bind(descriptor, name) for name in TASK_SERVICES])
    path = str(tmp_path / "task.sock")
    await server.start_path(path)
    client = await Client.connect(path)
    yield tasks, client
    await client.close()
    await server.close()
    await tasks.close()
    await publisher.close()


async def test_connect_before_any_other_call_makes_no_task_service(served) -> None:
    _, client = served
    for service in TASK_SERVICES:
        reply = await client.call(service, "Connect", api.ConnectRequest(id="c1"),
                                  api.ConnectResponse)
        assert (reply.shim_pid, reply.task_pid, reply.version) == (os.getpid(), 0, __version__)
    assert FakeTasks.made == []


async def test_the_first_other_call_makes_it_once_and_connect_then_asks_it(served) -> None:
    tasks, client = served
    with pytest.raises(TtrpcError) as err:
        await client.call(TASK_SERVICES[0], "State", api.StateRequest(id="nope"),
                          api.StateResponse)
    assert err.value.code == Code.NOT_FOUND
    state = await client.call(TASK_SERVICES[1], "State", api.StateRequest(id="c1"),
                              api.StateResponse)
    assert state.pid == 42
    reply = await client.call(TASK_SERVICES[1], "Connect", api.ConnectRequest(id="c1"),
                              api.ConnectResponse)
    assert (reply.task_pid, reply.version) == (42, "fake")
    assert len(FakeTasks.made) == 1 and tasks.get() is FakeTasks.made[0]
    await tasks.close()
    assert FakeTasks.made[0].closed


async def test_rpcs_the_service_lacks_are_unimplemented_before_and_after(served) -> None:
    tasks, client = served
    for _ in range(2):
        with pytest.raises(TtrpcError) as err:
            await client.call(TASK_SERVICES[0], "Pids", api.PidsRequest(id="c1"),
                              api.PidsResponse)
        assert err.value.code == Code.UNIMPLEMENTED and "Pids" in err.value.message
    assert len(FakeTasks.made) == 1
