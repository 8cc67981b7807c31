"""Unary calls as containerd makes them: round trips, concurrency, errors, timeouts."""
from __future__ import annotations

import asyncio
import logging
import random

import pytest

from podvm_core.pb.containerd.task.v2 import shim_pb2 as task
from podvm_core.ttrpc import Client, ConnectionClosed, Server, TtrpcError, bind
from podvm_core.ttrpc.codes import Code
from podvm_core.ttrpc.framing import MAX_DATA
from shim.api import errors
from shim.vm.hypervisor import VMExited

from .conftest import SERVICE, EchoTask


async def test_unary_round_trip(client: Client) -> None:
    resp = await client.call(SERVICE, "State", task.StateRequest(id="abc", exec_id="e1"),
                             task.StateResponse)
    assert (resp.id, resp.exec_id) == ("abc", "e1")


async def test_namespace_metadata_reaches_the_handler(server, socket_path: str) -> None:
    async with await Client.connect(
            socket_path, metadata=[("containerd-namespace-ttrpc", "k8s.io"),
                                   ("otel-trace", "x")]) as c:
        await c.call(SERVICE, "State", task.StateRequest(id="a"), task.StateResponse)
    assert server.impl.seen_namespaces == ["k8s.io"]


async def test_served_under_the_v3_name_too(socket_path: str) -> None:
    impl = EchoTask()
    desc = task.DESCRIPTOR.services_by_name["Task"]
    srv = Server([bind(desc, impl), bind(desc, impl, name="containerd.task.v3.Task")])
    await srv.start_path(socket_path)
    try:
        async with await Client.connect(socket_path) as c:
            resp = await c.call("containerd.task.v3.Task", "State", task.StateRequest(id="v3"),
                                task.StateResponse)
            assert resp.id == "v3"
    finally:
        await srv.close()


async def test_100_concurrent_calls_are_matched_by_stream_id(client: Client) -> None:
    delays = [random.randint(0, 50) for _ in range(100)]
    calls = [client.call(SERVICE, "Wait", task.WaitRequest(id=str(i), exec_id=str(d)),
                         task.WaitResponse) for i, d in enumerate(delays)]
    responses = await asyncio.gather(*calls)
    assert [r.exit_status for r in responses] == delays


async def test_unknown_service_and_method_are_unimplemented(client: Client) -> None:
    with pytest.raises(TtrpcError) as err:
        await client.call("no.such.Service", "State", task.StateRequest(), task.StateResponse)
    assert err.value.code == Code.UNIMPLEMENTED and "no.such.Service" in err.value.message
    with pytest.raises(TtrpcError) as err:
        await client.call(SERVICE, "Frobnicate", task.StateRequest(), task.StateResponse)
    assert err.value.code == Code.UNIMPLEMENTED and "Frobnicate" in err.value.message
    # Create exists in the proto but the test service does not implement it.
    with pytest.raises(TtrpcError) as err:
        await client.call(SERVICE, "Create", task.CreateTaskRequest(), task.CreateTaskResponse)
    assert err.value.code == Code.UNIMPLEMENTED


async def test_undecodable_payload_is_invalid_argument(client: Client) -> None:
    with pytest.raises(TtrpcError) as err:
        await client.call_raw(SERVICE, "State", b"\xff\xff\xff\xff")
    assert err.value.code == Code.INVALID_ARGUMENT
    # The connection is still usable.
    resp = await client.call(SERVICE, "State", task.StateRequest(id="ok"), task.StateResponse)
    assert resp.id == "ok"


async def test_handler_errors_carry_their_code(client: Client) -> None:
    with pytest.raises(TtrpcError) as err:
        await client.call(SERVICE, "Kill", task.KillRequest(id="gone"), task.StateResponse)
    assert err.value.code == Code.NOT_FOUND and "gone" in err.value.message
    with pytest.raises(TtrpcError) as err:
        await client.call(SERVICE, "Pids", task.PidsRequest(id="x"), task.PidsResponse)
    assert err.value.code == Code.UNKNOWN and "handler bug" in err.value.message


async def test_timeout_is_deadline_exceeded(client: Client) -> None:
    with pytest.raises(TtrpcError) as err:
        await client.call(SERVICE, "Wait", task.WaitRequest(exec_id="2000"), task.WaitResponse,
                          timeout=0.05)
    assert err.value.code == Code.DEADLINE_EXCEEDED
    fast = await client.call(SERVICE, "Wait", task.WaitRequest(exec_id="1"), task.WaitResponse,
                             timeout=5)
    assert fast.exit_status == 1


async def test_oversized_response_is_resource_exhausted(client: Client) -> None:
    with pytest.raises(TtrpcError) as err:
        await client.call(SERVICE, "Stats", task.StatsRequest(id=str(MAX_DATA)),
                          task.StatsResponse)
    assert err.value.code == Code.RESOURCE_EXHAUSTED
    ok = await client.call(SERVICE, "Stats", task.StatsRequest(id="10"), task.StatsResponse)
    assert ok.stats.value == b"x" * 10


async def test_oversized_request_is_refused_by_the_client(client: Client) -> None:
    with pytest.raises(TtrpcError) as err:
        await client.call_raw(SERVICE, "State", b"x" * MAX_DATA)
    assert err.value.code == Code.RESOURCE_EXHAUSTED


async def test_server_close_fails_outstanding_calls(server, socket_path: str) -> None:
    c = await Client.connect(socket_path)
    pending = asyncio.create_task(
        c.call(SERVICE, "Wait", task.WaitRequest(exec_id="5000"), task.WaitResponse))
    await asyncio.sleep(0.05)
    await server.close()
    with pytest.raises(ConnectionClosed):
        await pending
    await c.close()


async def test_close_with_grace_waits_for_the_peer_to_hang_up(server, socket_path: str) -> None:
    """The connection that just got an answer stays open until its client hangs up (a Go
    client may otherwise read the answer as "ttrpc: closed"), and no longer."""
    c = await Client.connect(socket_path)
    await c.call(SERVICE, "State", task.StateRequest(id="last"), task.StateResponse)
    closing = asyncio.create_task(server.close(grace=10))
    await asyncio.sleep(0.2)
    assert not closing.done()
    assert not c.closed
    t0 = asyncio.get_running_loop().time()
    await c.close()
    await asyncio.wait_for(closing, 5)
    assert asyncio.get_running_loop().time() - t0 < 2


async def test_close_with_grace_drops_a_peer_that_stays(server, socket_path: str) -> None:
    c = await Client.connect(socket_path)
    await c.call(SERVICE, "State", task.StateRequest(id="last"), task.StateResponse)
    t0 = asyncio.get_running_loop().time()
    await server.close(grace=0.3)
    assert 0.25 < asyncio.get_running_loop().time() - t0 < 3
    with pytest.raises(ConnectionClosed):
        await c.call(SERVICE, "State", task.StateRequest(id="late"), task.StateResponse)
    await c.close()


async def test_typed_errors_answer_the_code_of_the_error_table(tmp_path) -> None:
    """A handler's own typed error (here: the VM died) reaches containerd with the one
    code shim/api/errors.py gives it, not UNKNOWN, and the connection stays usable."""
    class Dying:
        async def State(self, req: task.StateRequest, ctx) -> task.StateResponse:
            raise VMExited("QEMU (pid 7) was killed by signal SIGKILL")

    path = str(tmp_path / "typed.sock")
    srv = Server([bind(task.DESCRIPTOR.services_by_name["Task"], Dying())],
                 answer=errors.to_ttrpc)
    await srv.start_path(path)
    c = await Client.connect(path)
    try:
        for _ in range(2):
            with pytest.raises(TtrpcError) as err:
                await c.call(SERVICE, "State", task.StateRequest(id="x"), task.StateResponse)
            assert err.value.code == Code.UNAVAILABLE
            assert err.value.message == "podvm: QEMU (pid 7) was killed by signal SIGKILL"
    finally:
        await c.close()
        await srv.close()


@pytest.fixture
def ttrpc_log():
    """What the server logs, at every level (the daemon's handler may not propagate)."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger = logging.getLogger("podvm.ttrpc")
    handler, level = Keep(logging.DEBUG), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield records
    logger.removeHandler(handler)
    logger.setLevel(level)


async def test_error_replies_are_logged_by_what_they_mean(socket_path: str, ttrpc_log) -> None:
    """NOT_FOUND is what containerd gets for every id it polls after deleting it: debug
    only. A request refused for another reason is worth a line; INTERNAL is the shim's
    own fault; a handler that crashes is logged with its traceback."""
    answers = {"gone": Code.NOT_FOUND, "bad": Code.FAILED_PRECONDITION,
               "broken": Code.INTERNAL}

    class Refusing:
        async def State(self, req: task.StateRequest, ctx) -> task.StateResponse:
            if req.id == "crash":
                raise RuntimeError("handler bug")
            raise TtrpcError(answers[req.id], f"{req.id} it is")

    srv = Server([bind(task.DESCRIPTOR.services_by_name["Task"], Refusing())])
    await srv.start_path(socket_path)
    try:
        async with await Client.connect(socket_path) as c:
            for name in (*answers, "crash"):
                with pytest.raises(TtrpcError):
                    await c.call(SERVICE, "State", task.StateRequest(id=name),
                                 task.StateResponse)
    finally:
        await srv.close()
    by_code = {r.args[2]: r.levelno for r in ttrpc_log if r.exc_info is None}
    assert by_code == {"NOT_FOUND": logging.DEBUG, "FAILED_PRECONDITION": logging.INFO,
                       "INTERNAL": logging.WARNING}
    assert [r.levelno for r in ttrpc_log if r.exc_info] == [logging.ERROR]


async def test_not_found_costs_no_log_line_at_info(client: Client, ttrpc_log) -> None:
    logging.getLogger("podvm.ttrpc").setLevel(logging.INFO)
    for _ in range(20):
        with pytest.raises(TtrpcError) as err:
            await client.call(SERVICE, "Kill", task.KillRequest(id="gone"), task.StateResponse)
        assert err.value.code == Code.NOT_FOUND
    assert ttrpc_log == []


async def test_a_handlers_own_timeout_without_a_deadline_is_its_failure(socket_path) -> None:
    class TimingOut:
        async def State(self, req: task.StateRequest, ctx) -> task.StateResponse:
            raise TimeoutError("the guest did not answer")

    srv = Server([bind(task.DESCRIPTOR.services_by_name["Task"], TimingOut())])
    await srv.start_path(socket_path)
    try:
        async with await Client.connect(socket_path) as c:
            with pytest.raises(TtrpcError) as err:
                await c.call(SERVICE, "State", task.StateRequest(id="x"), task.StateResponse)
            assert err.value.code == Code.UNKNOWN
            assert "TimeoutError: the guest did not answer" in err.value.message
            with pytest.raises(TtrpcError) as err:  # with a deadline: the deadline's code
                await c.call(SERVICE, "State", task.StateRequest(id="x"), task.StateResponse,
                             timeout=5)
            assert err.value.code == Code.DEADLINE_EXCEEDED
    finally:
        await srv.close()


async def test_a_deferred_service_is_made_at_its_first_call_only(socket_path: str) -> None:
    made: list[str] = []

    def make():
        made.append("made")
        if len(made) == 1:
            raise ImportError("not today")
        return bind(task.DESCRIPTOR.services_by_name["Task"], EchoTask(), name="later.Task")

    srv = Server()
    srv.register_deferred("later.Task", make)
    await srv.start_path(socket_path)
    try:
        async with await Client.connect(socket_path) as c:
            with pytest.raises(TtrpcError) as err:
                await c.call("other.Task", "State", task.StateRequest(), task.StateResponse)
            assert err.value.code == Code.UNIMPLEMENTED and made == []
            with pytest.raises(TtrpcError) as err:  # a failure to make it is answered
                await c.call("later.Task", "State", task.StateRequest(id="a"),
                             task.StateResponse)
            assert err.value.code == Code.UNKNOWN and "not today" in err.value.message
            for id_ in ("b", "c"):
                resp = await c.call("later.Task", "State", task.StateRequest(id=id_),
                                    task.StateResponse)
                assert resp.id == id_
            assert made == ["made", "made"]
    finally:
        await srv.close()
