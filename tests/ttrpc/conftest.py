"""A real ttrpc server on a unix socket, serving test handlers under the Task API."""
from __future__ import annotations

import asyncio
import pathlib

import pytest

from podvm_core.pb.containerd.task.v2 import shim_pb2 as task
from podvm_core.ttrpc import Client, Context, Server, TtrpcError, bind
from podvm_core.ttrpc.codes import Code

SERVICE = "containerd.task.v2.Task"


class EchoTask:
    """State echoes the id; Wait sleeps `exec_id` milliseconds; Kill raises; Pids crashes."""

    def __init__(self) -> None:
        self.seen_namespaces: list[str | None] = []

    async def State(self, req: task.StateRequest, ctx: Context) -> task.StateResponse:
        self.seen_namespaces.append(ctx.namespace)
        return task.StateResponse(id=req.id, exec_id=req.exec_id)

    async def Wait(self, req: task.WaitRequest, ctx: Context) -> task.WaitResponse:
        await asyncio.sleep(int(req.exec_id or 0) / 1000)
        return task.WaitResponse(exit_status=int(req.exec_id or 0))

    async def Kill(self, req: task.KillRequest, ctx: Context):
        raise TtrpcError(Code.NOT_FOUND, f"task {req.id} not found")

    async def Pids(self, req: task.PidsRequest, ctx: Context):
        raise RuntimeError("handler bug")

    async def Stats(self, req: task.StatsRequest, ctx: Context) -> task.StatsResponse:
        resp = task.StatsResponse()
        resp.stats.value = b"x" * int(req.id)
        return resp


@pytest.fixture
def socket_path(tmp_path: pathlib.Path) -> str:
    return str(tmp_path / "ttrpc.sock")


@pytest.fixture
async def server(socket_path: str):
    impl = EchoTask()
    srv = Server([bind(task.DESCRIPTOR.services_by_name["Task"], impl)])
    await srv.start_path(socket_path)
    srv.impl = impl  # type: ignore[attr-defined]
    yield srv
    await srv.close()


@pytest.fixture
async def client(server: Server, socket_path: str):
    c = await Client.connect(socket_path)
    yield c
    await c.close()
