"""The Sandbox API played as containerd 2.x's "shim" sandboxer plays it, over ttrpc on the
real shim binary, with a real VM (TCG): `start` with a bundle without config.json, then
CreateSandbox (a PodSandboxConfig), StartSandbox, a container through the Task API,
UpdateSandbox, status and metrics, StopSandbox, ShutdownSandbox; bad requests."""
from __future__ import annotations

import json
import os
import pathlib
import time
import uuid

import pytest

import cgroups
from shim.pb.containerd.cgroups.v1 import metrics_pb2 as v1
from shim.pb.containerd.runtime.sandbox.v1 import sandbox_pb2 as sb
from shim.pb.containerd.task.v2 import shim_pb2 as api
from shim.pb.cri import api_pb2 as cri
from shim.ttrpc import Client, Code, ConnectionClosed, TtrpcError
from tests.conftest import require_root
from tests.shim.shimproc import daemon_pid, run_shim
from tests.shim.test_process_contract import wait_gone
from tests.vmconfig import write_test_config

from .taskshim import NS, TASK, Fifos, busybox_rootfs, create, spec

SANDBOX = "containerd.runtime.sandbox.v1.Sandbox"
MIB = 1 << 20
SID = "sbapi"


@pytest.fixture(scope="module")
def rootfs(tmp_path_factory) -> pathlib.Path:
    return busybox_rootfs(tmp_path_factory.mktemp("busybox-rootfs"))


@pytest.fixture
async def shim(tmp_path):
    """`start` as containerd 2.x runs it for a sandbox: id = the sandbox id, a bundle
    with no config.json."""
    require_root()
    grpc = str(tmp_path / "containerd.sock")
    bundle = tmp_path / SID
    bundle.mkdir()
    (bundle / "log").touch()
    config = write_test_config(tmp_path / "podvm.toml", default_maxvcpus=2)
    env = dict(os.environ, PODVM_CONFIG=str(config))
    started = run_shim(bundle, SID, "start", grpc, namespace=NS, env=env)
    assert started.returncode == 0, started.stderr
    client = await Client.connect(started.stdout.decode(),
                                  metadata=[("containerd-namespace-ttrpc", NS)])
    parent = f"/podvm-sbapi-{uuid.uuid4().hex[:8]}"
    try:
        yield {"client": client, "bundle": bundle, "grpc": grpc, "tmp": tmp_path,
               "parent": parent, "pid": daemon_pid(NS, SID)}
    finally:
        await client.close()
        run_shim(bundle, SID, "delete", grpc, namespace=NS)
        for h in cgroups.detect().to_state().get("hierarchies", []):
            pod = pathlib.Path(h["mountpoint"]) / parent.strip("/")
            assert not (pod / f"podvm_{SID}").exists()
            for _ in range(50):  # a process killed by `delete` may still be leaving
                try:
                    pod.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.1)


async def call(ctx, method, request, response):
    return await ctx["client"].call(SANDBOX, method, request, response)


def pod_config(parent: str, quota: int, memory: int) -> cri.PodSandboxConfig:
    config = cri.PodSandboxConfig()
    config.metadata.name, config.metadata.uid = "api-pod", "uid-api-pod"
    config.linux.cgroup_parent = parent
    config.linux.resources.cpu_period = 100_000 if quota else 0
    config.linux.resources.cpu_quota = quota
    config.linux.resources.memory_limit_in_bytes = memory
    config.linux.overhead.memory_limit_in_bytes = 512 * MIB  # the RuntimeClass's
    return config


async def create_sandbox(ctx, config: cri.PodSandboxConfig, sandbox_id: str = SID):
    req = sb.CreateSandboxRequest(sandbox_id=sandbox_id, bundle_path=str(ctx["bundle"]))
    req.options.Pack(config)
    return await call(ctx, "CreateSandbox", req, sb.CreateSandboxResponse)


async def status(ctx) -> sb.SandboxStatusResponse:
    return await call(ctx, "SandboxStatus", sb.SandboxStatusRequest(sandbox_id=SID,
                                                                    verbose=True),
                      sb.SandboxStatusResponse)


async def test_sandbox_lifecycle_with_a_container_and_an_update(shim, rootfs) -> None:
    with pytest.raises(TtrpcError) as err:
        await call(shim, "StartSandbox", sb.StartSandboxRequest(sandbox_id=SID),
                   sb.StartSandboxResponse)
    assert err.value.code == Code.FAILED_PRECONDITION and "CreateSandbox first" in \
        err.value.message
    await create_sandbox(shim, pod_config(shim["parent"], 0, 128 * MIB))
    with pytest.raises(TtrpcError) as err:
        await create_sandbox(shim, pod_config(shim["parent"], 0, 128 * MIB))
    assert err.value.code == Code.ALREADY_EXISTS
    with pytest.raises(TtrpcError) as err:
        await call(shim, "SandboxStatus", sb.SandboxStatusRequest(sandbox_id="other"),
                   sb.SandboxStatusResponse)
    assert err.value.code == Code.NOT_FOUND
    assert (await status(shim)).state == "SANDBOX_NOTREADY"

    started = await call(shim, "StartSandbox", sb.StartSandboxRequest(sandbox_id=SID),
                         sb.StartSandboxResponse)
    assert f"podvm-{SID},".encode() in pathlib.Path(f"/proc/{started.pid}/cmdline").read_bytes()
    assert started.created_at.seconds > 0
    platform = await call(shim, "Platform", sb.PlatformRequest(sandbox_id=SID),
                          sb.PlatformResponse)
    assert (platform.platform.os, platform.platform.architecture) == ("linux", "amd64")
    await call(shim, "PingSandbox", sb.PingRequest(sandbox_id=SID), sb.PingResponse)
    ready = await status(shim)
    assert (ready.state, ready.pid) == ("SANDBOX_READY", started.pid)
    plan = json.loads(ready.info["plan"])
    assert (plan["vcpus"], plan["memory_mib"]) == (1, 384)  # 1 + 0 CPU, 256 + 128 MiB
    assert json.loads(ready.info["vm"]) == {"vcpus": 1, "memory_mib": 384}

    # A container in it, through the Task API: no pause container, the pod's pid
    # namespace is the guest holder's.
    bundle = shim["tmp"] / "c1"
    (bundle / "rootfs").mkdir(parents=True)
    c_spec = spec(["sh", "-c", "echo pid1=$(tr '\\0' ' ' < /proc/1/cmdline); sleep 1000"])
    c_spec["linux"]["namespaces"] = [{"type": "pid", "path": f"/proc/{started.pid}/ns/pid"},
                                     {"type": "ipc", "path": f"/proc/{started.pid}/ns/ipc"},
                                     {"type": "uts"}, {"type": "mount"}]
    c_spec["annotations"] = {"io.kubernetes.cri.sandbox-id": SID,
                             "io.kubernetes.cri.container-type": "container"}
    (bundle / "config.json").write_text(json.dumps(c_spec))
    task_ctx = dict(shim, rootfs=rootfs, options=api.CreateTaskRequest().options)
    fifos = Fifos(shim["tmp"], "c1")
    await create(task_ctx, "c1", bundle, fifos)
    await shim["client"].call(TASK, "Start", api.StartRequest(id="c1"), api.StartResponse)
    assert b"pid1=/bin/busybox sh -c trap" in await fifos.read(fifos.out, b"\n")  # the holder

    update = sb.UpdateSandboxRequest(sandbox_id=SID)
    update.resources.type_url = "types.containerd.io/opencontainers/runtime-spec/1/" \
                                "LinuxResources"
    update.resources.value = json.dumps({"cpu": {"quota": 100_000, "period": 100_000},
                                         "memory": {"limit": 256 * MIB}}).encode()
    await call(shim, "UpdateSandbox", update, sb.UpdateSandboxResponse)
    grown = await status(shim)
    assert json.loads(grown.info["vm"]) == {"vcpus": 2, "memory_mib": 512}
    plan = json.loads(grown.info["plan"])
    metrics = await call(shim, "SandboxMetrics", sb.SandboxMetricsRequest(sandbox_id=SID),
                         sb.SandboxMetricsResponse)
    assert metrics.metrics.id == SID
    assert metrics.metrics.data.type_url == "io.containerd.cgroups.v1.Metrics"
    m = v1.Metrics.FromString(metrics.metrics.data.value)
    assert m.memory.usage.limit == plan["cgroup_memory_limit"] == (512 + 256) * MIB
    assert m.memory.usage.usage > 0 and m.cpu.usage.total > 0 and m.pids.current > 0
    bad = sb.UpdateSandboxRequest(sandbox_id=SID)
    bad.resources.type_url = "example.com/Nonsense"
    with pytest.raises(TtrpcError) as err:
        await call(shim, "UpdateSandbox", bad, sb.UpdateSandboxResponse)
    assert err.value.code == Code.INVALID_ARGUMENT

    await shim["client"].call(TASK, "Kill", api.KillRequest(id="c1", signal=9),
                              api.StateResponse)
    await shim["client"].call(TASK, "Wait", api.WaitRequest(id="c1"), api.WaitResponse)
    await shim["client"].call(TASK, "Delete", api.DeleteRequest(id="c1"), api.DeleteResponse)

    await call(shim, "StopSandbox", sb.StopSandboxRequest(sandbox_id=SID, timeout_secs=30),
               sb.StopSandboxResponse)
    waited = await call(shim, "WaitSandbox", sb.WaitSandboxRequest(sandbox_id=SID),
                        sb.WaitSandboxResponse)
    assert waited.exited_at.seconds > 0
    assert (await status(shim)).state == "SANDBOX_NOTREADY"
    assert not pathlib.Path(f"/proc/{started.pid}").exists() or \
        " Z " in pathlib.Path(f"/proc/{started.pid}/stat").read_text()
    try:
        await call(shim, "ShutdownSandbox", sb.ShutdownSandboxRequest(sandbox_id=SID),
                   sb.ShutdownSandboxResponse)
    except ConnectionClosed:
        pass
    await wait_gone(shim["pid"], timeout=15)
    assert not pathlib.Path(f"/run/podvm/{NS}/{SID}").exists()


async def test_a_sandbox_that_cannot_fit_is_refused_before_boot(shim) -> None:
    with pytest.raises(TtrpcError) as err:
        await create_sandbox(shim, pod_config(shim["parent"], 0, 64 * 1024 * MIB))
    assert err.value.code == Code.RESOURCE_EXHAUSTED and "MiB of VM memory" in err.value.message
    bad = sb.CreateSandboxRequest(sandbox_id=SID)
    bad.options.type_url = "types.example.com/Other"
    with pytest.raises(TtrpcError) as err:
        await call(shim, "CreateSandbox", bad, sb.CreateSandboxResponse)
    assert err.value.code == Code.INVALID_ARGUMENT and "PodSandboxConfig" in err.value.message
    with pytest.raises(TtrpcError) as err:  # nothing was created by the refusals
        await call(shim, "StartSandbox", sb.StartSandboxRequest(sandbox_id=SID),
                   sb.StartSandboxResponse)
    assert err.value.code == Code.FAILED_PRECONDITION
    assert not pathlib.Path(f"/run/podvm/{NS}/{SID}/sandbox.json").exists()
