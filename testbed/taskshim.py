"""A pod's shim driven as containerd drives it: ttrpc on the shim's socket, FIFOs for
stdio, an events endpoint, a busybox rootfs; for tests and benchmarks that need a real
VM pod without containerd in between."""
from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import pathlib
import tarfile
import time
import uuid

from google.protobuf.empty_pb2 import Empty

from podvm_core.pb.containerd.runtimeoptions.v1.api_pb2 import Options
from podvm_core.pb.containerd.services.events.ttrpc.v1 import events_pb2
from podvm_core.pb.containerd.services.events.ttrpc.v1.events_pb2 import ForwardRequest
from podvm_core.pb.containerd.task.v2 import shim_pb2 as api
from podvm_core.pb.containerd.types.mount_pb2 import Mount
from podvm_core.ttrpc import Client, ConnectionClosed, Server, bind

from .image import _layer
from .namespaces import run_namespace
from .prereqs import require_root
from .shimproc import daemon_pid, run_shim, wait_gone
from .vmconfig import vmm_config, vmm_env, write_test_config

TASK = "containerd.task.v2.Task"
NS = run_namespace("podvm-task-test")


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
        # A network of its own (no path: no interface), as `ctr run` gives; none at all
        # would be the host's network, which podvm refuses.
        "linux": {"namespaces": [{"type": "pid"}, {"type": "ipc"}, {"type": "uts"},
                                 {"type": "mount"}, {"type": "network"}],
                  "resources": resources},
    }


def join_netns(spec: dict, netns: str) -> None:
    """The spec's network namespace becomes `netns` (a path), as containerd's CRI writes
    a sandbox's; "" keeps a namespace of its own."""
    if netns:
        for ns in spec["linux"]["namespaces"]:
            if ns["type"] == "network":
                ns["path"] = netns


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


def busybox_rootfs(root: pathlib.Path) -> pathlib.Path:
    with tarfile.open(fileobj=io.BytesIO(_layer())) as tar:
        tar.extractall(root)
    return root


class EventSink:
    """containerd's side of event publishing: records what the shim forwards."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []
        self.deleted: list[str] = []
        """The container ids of /tasks/delete events, in order."""

    async def Forward(self, req: ForwardRequest, ctx) -> Empty:
        self.events.append((req.envelope.topic, req.envelope.event.type_url))
        if req.envelope.topic == "/tasks/delete":
            from podvm_core.pb.containerd.events.task_pb2 import TaskDelete

            self.deleted.append(TaskDelete.FromString(req.envelope.event.value).container_id)
        return Empty()


@contextlib.asynccontextmanager
async def shim_daemon(tmp_path: pathlib.Path, rootfs: pathlib.Path, cgroups_path: str = "",
                      runtime: dict | None = None, netns: str = "", vmm: str = "qemu",
                      **qemu: object):
    """A pod's shim started as containerd starts it, its sandbox container (bundle
    `sb`) not created yet: with its cgroup under the parent of `cgroups_path`, by
    default a pod cgroup of the test's own; in the network namespace at `netns`, as CNI
    leaves one, else in one of its own with no interface; its VMs made by `vmm`
    (testbed/vmconfig.py VMMS: "fake" for testbed/fakevm.py's). Afterwards `delete`
    kills the daemon whatever happened, and the pod cgroup is removed."""
    require_root()
    grpc = str(tmp_path / "containerd.sock")
    sink = EventSink()
    events_server = Server([bind(events_pb2.DESCRIPTOR.services_by_name["Events"], sink)])
    await events_server.start_path(grpc + ".ttrpc")
    bundle = tmp_path / "sb"
    (bundle / "rootfs").mkdir(parents=True)
    sandbox_spec = spec(["sleep", "1000"])
    cgroups_path = cgroups_path or f"/podvm-tasktest-{uuid.uuid4().hex[:8]}/sb"
    sandbox_spec["linux"]["cgroupsPath"] = cgroups_path
    join_netns(sandbox_spec, netns)
    (bundle / "config.json").write_text(json.dumps(sandbox_spec))
    (bundle / "log").touch()  # the daemon logs here (containerd gives it a FIFO)
    started = run_shim(bundle, "sb", "start", grpc, namespace=NS,
                       env=vmm_env(dict(os.environ, TTRPC_ADDRESS=grpc + ".ttrpc"), vmm))
    assert started.returncode == 0, started.stderr
    client = await Client.connect(started.stdout.decode(),
                                  metadata=[("containerd-namespace-ttrpc", NS)])
    options = api.CreateTaskRequest().options
    config = write_test_config(tmp_path / "podvm.toml", runtime, **{**vmm_config(vmm), **qemu})
    options.Pack(Options(config_path=str(config)))
    ctx = {"client": client, "tmp": tmp_path, "rootfs": rootfs, "options": options,
           "grpc": grpc, "bundle": bundle, "events": sink.events,
           "deleted": sink.deleted, "cgroups_path": cgroups_path}
    try:
        yield ctx
    finally:
        await client.close()
        await events_server.close()
        run_shim(bundle, "sb", "delete", grpc, namespace=NS)
        remove_cgroup_dirs(cgroups_path.rsplit("/", 1)[0], "/podvm_overhead")


@contextlib.asynccontextmanager
async def task_shim(tmp_path: pathlib.Path, rootfs: pathlib.Path, cgroups_path: str = "",
                    runtime: dict | None = None, netns: str = "", vmm: str = "qemu",
                    **qemu: object):
    """shim_daemon's shim with the sandbox container created and started; stopped and
    removed afterwards as containerd does, checked to be gone."""
    async with shim_daemon(tmp_path, rootfs, cgroups_path, runtime, netns, vmm,
                           **qemu) as ctx:
        client, bundle, sink_events = ctx["client"], ctx["bundle"], ctx["events"]
        try:
            await create(ctx, "sb", bundle, Fifos(tmp_path, "sb"))
        except Exception:
            print((bundle / "log").read_text())
            raise
        await client.call(TASK, "Start", api.StartRequest(id="sb"), api.StartResponse)
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
        await wait_gone(pid, timeout=60)
        assert not os.path.exists(f"/run/podvm/{NS}/sb")
        sandbox_events = [t for t, _ in sink_events]
        assert sandbox_events[:2] == ["/tasks/create", "/tasks/start"]
        assert sandbox_events[-2:] == ["/tasks/exit", "/tasks/delete"]


def remove_cgroup_dirs(*paths: str) -> None:
    """Empty cgroup directories a test made (kubelet's pod cgroup in real life), in every
    hierarchy; one a process still leaves (a daemon `delete` just killed) gets a moment."""
    import cgroups

    state = cgroups.detect().to_state()
    mounts = [h["mountpoint"] for h in state.get("hierarchies", [])] or [state["mountpoint"]]
    for path in paths:
        for mount in mounts:
            directory = pathlib.Path(mount) / path.strip("/")
            for _ in range(50):
                try:
                    directory.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError as exc:
                    if exc.errno == 39:  # not empty: someone else's (another sandbox)
                        break
                    time.sleep(0.1)


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


