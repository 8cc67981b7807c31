"""The whole Task API driven as containerd drives it (ttrpc on the shim's socket, FIFOs
for stdio), on a real VM: what ctr and the CRI do not reach easily — stdin, terminals,
pause, pids, kill --all, bad requests."""
from __future__ import annotations

import asyncio
import io
import json
import os
import pathlib
import tarfile

import pytest

from google.protobuf.empty_pb2 import Empty

from shim.pb.containerd.services.events.ttrpc.v1 import events_pb2
from shim.pb.containerd.services.events.ttrpc.v1.events_pb2 import ForwardRequest
from shim.pb.containerd.runtimeoptions.v1.api_pb2 import Options
from shim.pb.containerd.task.v2 import shim_pb2 as api
from shim.pb.containerd.types.mount_pb2 import Mount
from shim.ttrpc import Client, Code, ConnectionClosed, Server, TtrpcError, bind
from tests.conftest import require_root
from tests.shim.shimproc import daemon_pid, run_shim
from tests.shim.test_process_contract import wait_gone
from tests.vmconfig import write_test_config

from .image import _layer

TASK = "containerd.task.v2.Task"
NS = "podvm-task-test"


def spec(args: list[str], terminal: bool = False, memory: int | None = None) -> dict:
    resources = {"memory": {"limit": memory}} if memory else {}
    return {
        "ociVersion": "1.0.2",
        "process": {"terminal": terminal, "user": {"uid": 0, "gid": 0}, "args": args,
                    "env": ["PATH=/bin", "TERM=xterm"], "cwd": "/"},
        "root": {"path": "rootfs"},
        "hostname": "task-api",
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
             "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
            {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
             "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]},
            {"destination": "/sys", "type": "sysfs", "source": "sysfs",
             "options": ["nosuid", "noexec", "nodev", "ro"]},
        ],
        "linux": {"namespaces": [{"type": "pid"}, {"type": "ipc"}, {"type": "uts"},
                                 {"type": "mount"}],
                  "resources": resources},
    }


class Fifos:
    """containerd's side of a process's stdio."""

    def __init__(self, directory: pathlib.Path, name: str, stdin: bool = False) -> None:
        self.paths = {s: str(directory / f"{name}-{s}") for s in ("stdin", "stdout", "stderr")}
        for p in self.paths.values():
            os.mkfifo(p)
        self.out = os.open(self.paths["stdout"], os.O_RDONLY | os.O_NONBLOCK)
        self.err = os.open(self.paths["stderr"], os.O_RDONLY | os.O_NONBLOCK)
        self.stdin = stdin

    def request_fields(self) -> dict:
        return {"stdin": self.paths["stdin"] if self.stdin else "",
                "stdout": self.paths["stdout"], "stderr": self.paths["stderr"]}

    async def read(self, fd: int, until: bytes, timeout: float = 30) -> bytes:
        data = b""
        async with asyncio.timeout(timeout):
            while until not in data:
                try:
                    chunk = os.read(fd, 65536)
                    data += chunk
                except BlockingIOError:
                    await asyncio.sleep(0.05)
        return data


@pytest.fixture(scope="module")
def rootfs(tmp_path_factory) -> pathlib.Path:
    root = tmp_path_factory.mktemp("busybox-rootfs")
    with tarfile.open(fileobj=io.BytesIO(_layer())) as tar:
        tar.extractall(root)
    return root


class EventSink:
    """containerd's side of event publishing: records what the shim forwards."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []

    async def Forward(self, req: ForwardRequest, ctx) -> Empty:
        self.events.append((req.envelope.topic, req.envelope.event.type_url))
        return Empty()


@pytest.fixture
async def shim(tmp_path, rootfs):
    """A pod's shim started as containerd starts it, with the sandbox container created."""
    require_root()
    grpc = str(tmp_path / "containerd.sock")
    sink = EventSink()
    events_server = Server([bind(events_pb2.DESCRIPTOR.services_by_name["Events"], sink)])
    await events_server.start_path(grpc + ".ttrpc")
    bundle = tmp_path / "sb"
    (bundle / "rootfs").mkdir(parents=True)
    (bundle / "config.json").write_text(json.dumps(spec(["sleep", "1000"])))
    (bundle / "log").touch()  # the daemon logs here (containerd gives it a FIFO)
    started = run_shim(bundle, "sb", "start", grpc, namespace=NS,
                       env=dict(os.environ, TTRPC_ADDRESS=grpc + ".ttrpc"))
    assert started.returncode == 0, started.stderr
    client = await Client.connect(started.stdout.decode(),
                                  metadata=[("containerd-namespace-ttrpc", NS)])
    options = api.CreateTaskRequest().options
    options.Pack(Options(config_path=str(write_test_config(tmp_path / "podvm.toml"))))
    ctx = {"client": client, "tmp": tmp_path, "rootfs": rootfs, "options": options,
           "grpc": grpc, "bundle": bundle, "events": sink.events}
    try:
        await create(ctx, "sb", bundle, Fifos(tmp_path, "sb"))
    except Exception:
        print((bundle / "log").read_text())
        raise
    await client.call(TASK, "Start", api.StartRequest(id="sb"), api.StartResponse)
    try:
        yield ctx
        await client.call(TASK, "Kill", api.KillRequest(id="sb", signal=9, all=True),
                          api.StateResponse)
        waited = await client.call(TASK, "Wait", api.WaitRequest(id="sb"), api.WaitResponse)
        assert waited.exit_status == 137
        await client.call(TASK, "Delete", api.DeleteRequest(id="sb"), api.DeleteResponse)
        pid = daemon_pid(NS, "sb")
        try:
            await client.call(TASK, "Shutdown", api.ShutdownRequest(id="sb"),
                              api.StateResponse)
        except ConnectionClosed:
            pass  # containerd takes a closed connection during Shutdown as success
        await wait_gone(pid, timeout=15)
        assert not os.path.exists(f"/run/podvm/{NS}/sb")
        sandbox_events = [t for t, _ in sink.events]
        assert sandbox_events[:2] == ["/tasks/create", "/tasks/start"]
        assert sandbox_events[-2:] == ["/tasks/exit", "/tasks/delete"]
    finally:
        await client.close()
        await events_server.close()
        run_shim(bundle, "sb", "delete", grpc, namespace=NS)


async def create(ctx: dict, cid: str, bundle: pathlib.Path, fifos: Fifos,
                 terminal: bool = False) -> api.CreateTaskResponse:
    req = api.CreateTaskRequest(id=cid, bundle=str(bundle), terminal=terminal,
                                rootfs=[Mount(type="bind", source=str(ctx["rootfs"]),
                                              options=["rbind", "rw"])],
                                **fifos.request_fields())
    req.options.CopyFrom(ctx["options"])
    return await ctx["client"].call(TASK, "Create", req, api.CreateTaskResponse)


def workload_bundle(ctx: dict, cid: str, **kw) -> pathlib.Path:
    bundle = ctx["tmp"] / cid
    (bundle / "rootfs").mkdir(parents=True)
    s = spec(**kw)
    s["annotations"] = {"io.kubernetes.cri.sandbox-id": "sb",
                        "io.kubernetes.cri.container-type": "container"}
    (bundle / "config.json").write_text(json.dumps(s))
    return bundle


async def call(ctx, method, request, response=api.StateResponse):
    return await ctx["client"].call(TASK, method, request, response)


async def test_stdin_reaches_the_container_and_eof_ends_it(shim) -> None:
    fifos = Fifos(shim["tmp"], "cat", stdin=True)
    await create(shim, "cat", workload_bundle(shim, "cat", args=["cat"]), fifos)
    await call(shim, "Start", api.StartRequest(id="cat"), api.StartResponse)
    writer = os.open(fifos.paths["stdin"], os.O_WRONLY)
    os.write(writer, b"through the VM\n")
    assert b"through the VM\n" in await fifos.read(fifos.out, b"\n")
    os.close(writer)  # end of stdin: cat exits 0
    waited = await call(shim, "Wait", api.WaitRequest(id="cat"), api.WaitResponse)
    assert waited.exit_status == 0
    deleted = await call(shim, "Delete", api.DeleteRequest(id="cat"), api.DeleteResponse)
    assert deleted.exit_status == 0
    expected = ["/tasks/create", "/tasks/start", "/tasks/exit", "/tasks/delete"]
    async with asyncio.timeout(10):  # events are forwarded in order, after the answers
        while len(shim["events"]) < 2 + len(expected):
            await asyncio.sleep(0.05)
    assert [t for t, _ in shim["events"]][2:] == expected  # after the sandbox's two
    assert ("/tasks/exit", "containerd.events.TaskExit") in shim["events"]


async def test_terminal_and_resize(shim) -> None:
    fifos = Fifos(shim["tmp"], "tty")
    script = "stty size; tty -s && echo is-a-tty; sleep 1000"
    await create(shim, "tty", workload_bundle(shim, "tty", args=["sh", "-c", script],
                                              terminal=True), fifos, terminal=True)
    await call(shim, "Start", api.StartRequest(id="tty"), api.StartResponse)
    assert b"is-a-tty" in await fifos.read(fifos.out, b"is-a-tty")
    await call(shim, "ResizePty", api.ResizePtyRequest(id="tty", width=100, height=40))
    with pytest.raises(TtrpcError) as err:  # no terminal on the sandbox
        await call(shim, "ResizePty", api.ResizePtyRequest(id="sb", width=1, height=1))
    assert err.value.code == Code.FAILED_PRECONDITION
    await call(shim, "Kill", api.KillRequest(id="tty", signal=9))
    waited = await call(shim, "Wait", api.WaitRequest(id="tty"), api.WaitResponse)
    assert waited.exit_status == 137
    await call(shim, "Delete", api.DeleteRequest(id="tty"), api.DeleteResponse)


async def test_bad_requests_answer_codes_and_leave_nothing(shim) -> None:
    fifos = Fifos(shim["tmp"], "bad")
    with pytest.raises(TtrpcError) as err:
        await create(shim, "bad", shim["tmp"] / "nonexistent", fifos)
    assert err.value.code == Code.INVALID_ARGUMENT
    bundle = workload_bundle(shim, "bad", args=["/no/such/binary"])
    with pytest.raises(TtrpcError) as err:
        await create(shim, "bad", bundle, fifos)
    assert err.value.code == Code.FAILED_PRECONDITION and "no/such/binary" in err.value.message
    assert not os.path.ismount(bundle / "rootfs")
    shared = pathlib.Path(f"/run/podvm/{NS}/sb/shared")
    assert sorted(os.listdir(shared)) == ["sb"]  # only the sandbox's rootfs is shared
    with pytest.raises(TtrpcError) as err:
        await create(shim, "sb", shim["bundle"], fifos)
    assert err.value.code == Code.ALREADY_EXISTS


async def test_pause_update_pids_stats_and_kill_all(shim) -> None:
    fifos = Fifos(shim["tmp"], "busy")
    script = "sleep 1000 & sleep 1000 & echo started; wait"
    await create(shim, "busy", workload_bundle(shim, "busy", args=["sh", "-c", script],
                                               memory=64 << 20), fifos)
    await call(shim, "Start", api.StartRequest(id="busy"), api.StartResponse)
    assert b"started" in await fifos.read(fifos.out, b"started")
    async with asyncio.timeout(30):
        pids = await call(shim, "Pids", api.PidsRequest(id="busy"), api.PidsResponse)
    assert len(pids.processes) == 3, pids  # sh and its two sleeps
    async with asyncio.timeout(30):
        await call(shim, "Pause", api.PauseRequest(id="busy"))
    state = await call(shim, "State", api.StateRequest(id="busy"))
    assert state.status == 4  # PAUSED
    async with asyncio.timeout(30):
        await call(shim, "Resume", api.ResumeRequest(id="busy"))
    state = await call(shim, "State", api.StateRequest(id="busy"))
    assert state.status == 2  # RUNNING
    update = api.UpdateTaskRequest(id="busy")
    update.resources.type_url = "types.containerd.io/opencontainers/runtime-spec/1/LinuxResources"
    update.resources.value = json.dumps({"memory": {"limit": 96 << 20}}).encode()
    async with asyncio.timeout(30):
        await call(shim, "Update", update)
        stats = await call(shim, "Stats", api.StatsRequest(id="busy"), api.StatsResponse)
    from shim.pb.containerd.cgroups.v2 import metrics_pb2
    assert stats.stats.type_url == "io.containerd.cgroups.v2.Metrics"  # containerd's name
    metrics = metrics_pb2.Metrics.FromString(stats.stats.value)
    assert metrics.memory.usage_limit == 96 << 20
    assert metrics.pids.current == 3
    async with asyncio.timeout(30):
        await call(shim, "Kill", api.KillRequest(id="busy", signal=9, all=True))
        waited = await call(shim, "Wait", api.WaitRequest(id="busy"), api.WaitResponse)
    assert waited.exit_status == 137
    await call(shim, "Delete", api.DeleteRequest(id="busy"), api.DeleteResponse)
