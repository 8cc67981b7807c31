"""Requests containerd 2.x (or a confused caller) may send that must be refused with the
right code, before any VM boots: unknown sandbox ids, Start before Create, a second
Create, options that are not a PodSandboxConfig, a pod that cannot fit; and a sandbox
shut down without ever starting leaves nothing behind."""
from __future__ import annotations

import asyncio
import json
import os
import pathlib
import time

import pytest

from podvm_core.pb.containerd.runtime.sandbox.v1 import sandbox_pb2 as sb
from podvm_core.pb.containerd.task.v2 import shim_pb2 as api
from podvm_core.ttrpc import Code, TtrpcError
from testbed.shimproc import network_workers, wait_gone
from testbed.taskshim import TASK, spec

from tests.api.sandbox.harness import KATA_DEFAULT_MEMORY, MIB, NS, cgroup_exists, sandbox_shim

# Every RPC that names a sandbox, with a request for `sandbox_id`.
BY_ID = {
    "StartSandbox": (lambda i: sb.StartSandboxRequest(sandbox_id=i), sb.StartSandboxResponse),
    "Platform": (lambda i: sb.PlatformRequest(sandbox_id=i), sb.PlatformResponse),
    "StopSandbox": (lambda i: sb.StopSandboxRequest(sandbox_id=i), sb.StopSandboxResponse),
    "WaitSandbox": (lambda i: sb.WaitSandboxRequest(sandbox_id=i), sb.WaitSandboxResponse),
    "SandboxStatus": (lambda i: sb.SandboxStatusRequest(sandbox_id=i),
                      sb.SandboxStatusResponse),
    "PingSandbox": (lambda i: sb.PingRequest(sandbox_id=i), sb.PingResponse),
    "SandboxMetrics": (lambda i: sb.SandboxMetricsRequest(sandbox_id=i),
                       sb.SandboxMetricsResponse),
    "UpdateSandbox": (lambda i: sb.UpdateSandboxRequest(sandbox_id=i, annotations={"a": "b"}),
                      sb.UpdateSandboxResponse),
    "ShutdownSandbox": (lambda i: sb.ShutdownSandboxRequest(sandbox_id=i),
                        sb.ShutdownSandboxResponse),
}


async def refused(pod, method: str, request, response_type) -> TtrpcError:
    with pytest.raises(TtrpcError) as err:
        await pod.call(method, request, response_type)
    return err.value


@pytest.fixture
async def pod(tmp_path):
    async with sandbox_shim(tmp_path, enable_annotations=("default_memory",)) as pod:
        yield pod


async def test_start_before_create_and_unknown_ids(pod) -> None:
    err = await refused(pod, "StartSandbox", sb.StartSandboxRequest(sandbox_id=pod.id),
                        sb.StartSandboxResponse)
    assert err.code == Code.FAILED_PRECONDITION and "CreateSandbox first" in err.message
    for method, (request, response_type) in BY_ID.items():
        if method == "StartSandbox":
            continue
        err = await refused(pod, method, request(pod.id), response_type)
        assert err.code == Code.NOT_FOUND, (method, err)
        assert pod.id in err.message

    await pod.create(pod.config(memory=128 * MIB))
    for method, (request, response_type) in BY_ID.items():
        err = await refused(pod, method, request("no-such-sandbox"), response_type)
        assert err.code == Code.NOT_FOUND, (method, err)
        assert "no-such-sandbox" in err.message and pod.id in err.message
    for method, (request, response_type) in BY_ID.items():
        if method not in ("StartSandbox", "ShutdownSandbox", "StopSandbox", "WaitSandbox"):
            continue
        err = await refused(pod, method, request(""), response_type)
        assert err.code == Code.INVALID_ARGUMENT, (method, err)


async def test_a_second_create_is_refused_and_changes_nothing(pod) -> None:
    await pod.create(pod.config(memory=128 * MIB))
    for sandbox_id in (pod.id, "another-pod"):
        err = await refused(pod, "CreateSandbox", sb.CreateSandboxRequest(
            sandbox_id=sandbox_id), sb.CreateSandboxResponse)
        assert err.code == Code.ALREADY_EXISTS and pod.id in err.message
    plan = json.loads((await pod.status()).info["plan"])
    assert plan["memory_mib"] == 256 + 128  # still the first Create's


async def test_bad_options_are_invalid_arguments(pod) -> None:
    err = await refused(pod, "CreateSandbox", sb.CreateSandboxRequest(), sb.CreateSandboxResponse)
    assert err.code == Code.INVALID_ARGUMENT and "sandbox id is empty" in err.message

    other = sb.CreateSandboxRequest(sandbox_id=pod.id)
    other.options.type_url = "types.containerd.io/runtimeoptions.v1.Options"
    err = await refused(pod, "CreateSandbox", other, sb.CreateSandboxResponse)
    assert err.code == Code.INVALID_ARGUMENT and "PodSandboxConfig" in err.message

    garbage = sb.CreateSandboxRequest(sandbox_id=pod.id)
    garbage.options.type_url = "type.googleapis.com/runtime.v1.PodSandboxConfig"
    garbage.options.value = b"\xff\xff\xff"
    err = await refused(pod, "CreateSandbox", garbage, sb.CreateSandboxResponse)
    assert err.code == Code.INVALID_ARGUMENT and "not a PodSandboxConfig" in err.message

    with pytest.raises(TtrpcError) as caught:  # not allowed by enable_annotations
        await pod.create(pod.config(memory=128 * MIB, annotations={
            "io.katacontainers.config.hypervisor.default_vcpus": "2"}))
    assert caught.value.code == Code.INVALID_ARGUMENT
    assert "enable_annotations" in caught.value.message

    with pytest.raises(TtrpcError) as caught:
        await pod.create(pod.config(memory=128 * MIB, annotations={KATA_DEFAULT_MEMORY: "x"}))
    assert caught.value.code == Code.INVALID_ARGUMENT

    # None of the refusals created the sandbox.
    err = await refused(pod, "StartSandbox", sb.StartSandboxRequest(sandbox_id=pod.id),
                        sb.StartSandboxResponse)
    assert err.code == Code.FAILED_PRECONDITION


async def test_a_pod_that_cannot_fit_is_refused_before_anything_boots(pod) -> None:
    with pytest.raises(TtrpcError) as caught:  # larger than the host and the maxima
        await pod.create(pod.config(memory=64 * 1024 * MIB))
    assert caught.value.code == Code.RESOURCE_EXHAUSTED
    assert "MiB" in caught.value.message
    with pytest.raises(TtrpcError) as caught:  # the overhead does not cover the VM
        await pod.create(pod.config(memory=128 * MIB, overhead_memory=64 * MIB))
    assert caught.value.code == Code.RESOURCE_EXHAUSTED
    assert "overhead.podFixed.memory" in caught.value.message
    assert not pathlib.Path(f"/run/podvm/{NS}/{pod.id}/sandbox.json").exists()
    assert not cgroup_exists(pod.parent)
    await pod.create(pod.config(memory=128 * MIB))  # a refusal left nothing in the way


async def test_the_plan_comes_from_the_whole_pod_sandbox_config(pod) -> None:
    """Resources, the overhead (the pod cgroup kubelet makes) and annotations, all
    before anything boots."""
    await pod.create(pod.config(quota=100_000, memory=256 * MIB, overhead_memory=1024 * MIB,
                                annotations={KATA_DEFAULT_MEMORY: "512"}))
    status = await pod.status()
    assert (status.state, status.pid, status.info["phase"]) == ("SANDBOX_NOTREADY", 0,
                                                                 "created")
    plan = json.loads(status.info["plan"])
    assert plan["vcpus"] == 2  # 1 for the guest + 1 CPU
    assert plan["memory_mib"] == 512 + 256  # the annotation's default_memory + the pod's
    assert plan["cgroup_cpu_quota"] == 200_000 and plan["cgroup_cpu_period"] == 100_000
    assert plan["pod_cgroup_memory_mib"] == 256 + 1024  # limits + the RuntimeClass overhead
    assert "vm" not in status.info  # nothing runs
    assert not cgroup_exists(f"{pod.parent}/podvm_{pod.id}")
    platform = await pod.call("Platform", sb.PlatformRequest(sandbox_id=pod.id),
                              sb.PlatformResponse)
    assert (platform.platform.os, platform.platform.architecture) == ("linux", "amd64")


async def test_a_cpu_overhead_too_small_for_the_guest_is_refused_at_create(pod) -> None:
    """kubelet's pod cgroup holds the CPU limits plus the declared overhead: the guest's
    own vCPU must fit in it, as it must through the Task API."""
    with pytest.raises(TtrpcError) as caught:
        await pod.create(pod.config(quota=100_000, memory=256 * MIB, overhead_quota=50_000))
    err = caught.value
    assert err.code == Code.RESOURCE_EXHAUSTED
    assert "overhead.podFixed.cpu >= 1000m" in err.message, err.message


async def test_nothing_runs_before_start(pod) -> None:
    await pod.create(pod.config(memory=128 * MIB))
    for method in ("PingSandbox", "SandboxMetrics", "UpdateSandbox"):
        request, response_type = BY_ID[method]
        err = await refused(pod, method, request(pod.id), response_type)
        assert err.code == Code.FAILED_PRECONDITION and "created" in err.message, method
    bundle = pod.tmp / "c1"
    (bundle / "rootfs").mkdir(parents=True)
    c_spec = spec(["true"])
    c_spec["annotations"] = {"io.kubernetes.cri.sandbox-id": pod.id,
                             "io.kubernetes.cri.container-type": "container"}
    (bundle / "config.json").write_text(json.dumps(c_spec))
    with pytest.raises(TtrpcError) as caught:
        await pod.client.call(TASK, "Create", api.CreateTaskRequest(id="c1", bundle=str(bundle)),
                              api.CreateTaskResponse)
    assert caught.value.code == Code.FAILED_PRECONDITION


async def test_shutdown_of_a_sandbox_never_started_leaves_nothing(pod) -> None:
    await pod.create(pod.config(memory=128 * MIB))
    waiting = asyncio.ensure_future(pod.call("WaitSandbox", sb.WaitSandboxRequest(
        sandbox_id=pod.id), sb.WaitSandboxResponse))
    await asyncio.sleep(0.1)
    assert not waiting.done()
    await pod.call("StopSandbox", sb.StopSandboxRequest(sandbox_id=pod.id),
                   sb.StopSandboxResponse)
    waited = await asyncio.wait_for(waiting, 60)
    assert waited.exit_status == 0 and waited.exited_at.seconds > 0
    assert (await pod.status()).state == "SANDBOX_NOTREADY"
    err = await refused(pod, "StartSandbox", sb.StartSandboxRequest(sandbox_id=pod.id),
                        sb.StartSandboxResponse)
    assert err.code == Code.FAILED_PRECONDITION and "stopped" in err.message
    # answered before the shim exits: containerd's sandbox controller takes
    # no answer as a failed shutdown
    await pod.call("ShutdownSandbox", sb.ShutdownSandboxRequest(sandbox_id=pod.id),
                   sb.ShutdownSandboxResponse)
    await wait_gone(pod.daemon_pid, timeout=60)
    assert not os.path.exists(pod.address.removeprefix("unix://"))
    assert not os.path.exists(f"/run/podvm/{NS}/{pod.id}")
    assert not cgroup_exists(pod.parent)


async def test_a_sandbox_stopped_before_start_ends_its_early_network_worker(pod) -> None:
    req = sb.CreateSandboxRequest(sandbox_id=pod.id, bundle_path=str(pod.bundle),
                                  netns_path="/var/run/netns/podvm-never-used")
    req.options.Pack(pod.config(memory=128 * MIB))
    await pod.call("CreateSandbox", req, sb.CreateSandboxResponse)
    # started at Create, for the boot (a worker parent forks it as it reads the request)
    deadline = time.monotonic() + 10
    while not network_workers(pod.daemon_pid) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    (worker,) = network_workers(pod.daemon_pid)
    await pod.call("StopSandbox", sb.StopSandboxRequest(sandbox_id=pod.id),
                   sb.StopSandboxResponse)
    assert network_workers(pod.daemon_pid) == []
    assert not os.path.exists(f"/proc/{worker}")
    await pod.call("ShutdownSandbox", sb.ShutdownSandboxRequest(sandbox_id=pod.id),
                   sb.ShutdownSandboxResponse)
    await wait_gone(pod.daemon_pid, timeout=60)


@pytest.mark.parametrize("option, field", [("network", "hostNetwork"), ("pid", "hostPID"),
                                           ("ipc", "hostIPC")])
async def test_a_pod_sharing_host_namespaces_is_refused_before_anything_boots(
        pod, option: str, field: str) -> None:
    config = pod.config()
    setattr(config.linux.security_context.namespace_options, option, 2)  # NODE
    with pytest.raises(TtrpcError) as err:
        await pod.create(config)
    assert err.value.code == Code.INVALID_ARGUMENT
    assert f"{field}: true" in err.value.message and "runc" in err.value.message
    assert not cgroup_exists(pod.sandbox_cgroup)
    # Nothing was taken: the same sandbox on a network of its own is created.
    await pod.create(pod.config())
