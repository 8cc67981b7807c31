"""A whole pod through the Sandbox API as containerd 2.x's "shim" sandboxer drives it,
on the real shim binary with a real VM (TCG): Create plans without booting, Start boots
the VM in the pod's sandbox cgroup, a container joins the pod through the Task API of
the same shim (its `start` finds the sandbox's daemon), UpdateSandbox grows and shrinks
the VM and the sandbox cgroup, status and metrics report both, Stop ends the container
still running, and Shutdown leaves nothing behind. A VM that dies (the host's side of
it) on a FakeVM (testbed/fakevm.py)."""
from __future__ import annotations

import asyncio
import json
import os
import pathlib

import pytest
from google.protobuf.empty_pb2 import Empty

from podvm_core.pb.containerd.runtime.sandbox.v1 import sandbox_pb2 as sb
from podvm_core.pb.containerd.task.v2 import shim_pb2 as api
from podvm_core.pb.cri import api_pb2 as cri
from podvm_core.ttrpc import Code, TtrpcError
from shim.config import MEASURED_OVERHEAD_MIB
from testbed.containerd import in_mount_namespace, mount_namespace, mounts_under
from testbed.shimproc import alive, daemon_pid, run_shim, wait_gone
from testbed.taskshim import TASK, Fifos, busybox_rootfs, create, spec

from tests.api.sandbox.harness import (MIB, NS, cgroup_exists, cgroup_file, cgroup_of,
                                       sandbox_shim, v2)

LINUX_RESOURCES = "types.containerd.io/opencontainers/runtime-spec/1/LinuxResources"
TCG_QEMU_OVERHEAD_MIB = MEASURED_OVERHEAD_MIB["tcg"]  # memory_overhead's default


@pytest.fixture(scope="module")
def rootfs(tmp_path_factory) -> pathlib.Path:
    return busybox_rootfs(tmp_path_factory.mktemp("busybox-rootfs"))


def host_limits(pod) -> tuple[str | None, str | None]:
    """(CPU quota, memory limit) of the sandbox cgroup, as the kernel has them."""
    if v2():
        cpu = cgroup_file(f"{pod.sandbox_cgroup}/vcpus", "cpu.max")
        return cpu and cpu.split()[0], cgroup_file(pod.sandbox_cgroup, "memory.max")
    return (cgroup_file(pod.sandbox_cgroup, "cpu.cfs_quota_us"),
            cgroup_file(pod.sandbox_cgroup, "memory.limit_in_bytes"))


def vms(sandbox_id: str) -> list[int]:
    """The QEMUs running for this sandbox."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if f"podvm-{sandbox_id},".encode() in pathlib.Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(int(pid))
        except OSError:
            continue
    return found


def info(status: sb.SandboxStatusResponse, key: str) -> dict:
    return json.loads(status.info[key])


async def update(pod, resources: dict | cri.PodSandboxConfig, **annotations: str) -> None:
    req = sb.UpdateSandboxRequest(sandbox_id=pod.id, annotations=annotations)
    if isinstance(resources, dict):
        req.resources.type_url = LINUX_RESOURCES
        req.resources.value = json.dumps(resources).encode()
    else:
        req.resources.Pack(resources)
    await pod.call("UpdateSandbox", req, sb.UpdateSandboxResponse)


async def test_a_pod_through_the_sandbox_api(tmp_path, rootfs) -> None:
    async with sandbox_shim(tmp_path) as pod:
        await pod.create(pod.config(memory=128 * MIB))
        assert not cgroup_exists(pod.sandbox_cgroup)  # planned, nothing booted

        started = await pod.call("StartSandbox", sb.StartSandboxRequest(sandbox_id=pod.id),
                                 sb.StartSandboxResponse)
        qemu = started.pid
        assert f"podvm-{pod.id},".encode() in pathlib.Path(f"/proc/{qemu}/cmdline").read_bytes()
        assert started.created_at.seconds > 0
        # QEMU runs in the pod's sandbox cgroup, under the cgroup parent CRI gave
        assert cgroup_of(qemu, "" if v2() else "memory") == pod.sandbox_cgroup
        await pod.call("PingSandbox", sb.PingRequest(sandbox_id=pod.id), sb.PingResponse)
        ready = await pod.status()
        assert (ready.state, ready.pid, ready.sandbox_id) == ("SANDBOX_READY", qemu, pod.id)
        assert ready.created_at == started.created_at
        plan = info(ready, "plan")
        assert (plan["vcpus"], plan["memory_mib"]) == (1, 256 + 128)
        # QEMU has every vCPU the pod may grow to (under TCG all are plugged at boot,
        # default_maxvcpus 2); the guest brought up the plan's one
        assert info(ready, "vm") == {"vcpus": 2, "memory_mib": 384}
        assert info(ready, "guest")["online_cpus"] == 1
        quota, memory = host_limits(pod)
        assert quota in ("-1", "max")  # the pod has no CPU limit
        assert int(memory) == (384 + TCG_QEMU_OVERHEAD_MIB) * MIB

        # containerd 1.x-style `start` for a container of the pod finds the same daemon
        c_bundle = tmp_path / "c1"
        (c_bundle / "rootfs").mkdir(parents=True)
        c_spec = spec(["sh", "-c", "echo pid1=$(tr '\\0' ' ' < /proc/1/cmdline) "
                       "host=$(hostname); exec sleep 1000"])
        c_spec["linux"]["namespaces"] = [  # CRI's, for a pod sharing its process namespace
            {"type": "pid", "path": f"/proc/{qemu}/ns/pid"},
            {"type": "ipc", "path": f"/proc/{qemu}/ns/ipc"},
            {"type": "uts", "path": f"/proc/{qemu}/ns/uts"}, {"type": "mount"}]
        c_spec.pop("hostname", None)  # CRI sets none: the pod's UTS namespace names it
        c_spec["annotations"] = {"io.kubernetes.cri.sandbox-id": pod.id,
                                 "io.kubernetes.cri.container-type": "container"}
        (c_bundle / "config.json").write_text(json.dumps(c_spec))
        again = run_shim(c_bundle, "c1", "start", pod.grpc, namespace=NS, env=pod.env)
        assert again.returncode == 0, again.stderr
        assert again.stdout.decode() == pod.address
        assert daemon_pid(NS, pod.id) == pod.daemon_pid
        assert (c_bundle / "address").read_text() == pod.address

        task = {"client": pod.client, "rootfs": rootfs,
                "options": api.CreateTaskRequest().options}
        fifos = Fifos(tmp_path, "c1")
        created = await create(task, "c1", c_bundle, fifos)
        assert created.pid == qemu
        await pod.client.call(TASK, "Start", api.StartRequest(id="c1"), api.StartResponse)
        # no pause container: PID 1 of the pod is the agent's namespace holder
        line = await fifos.read(fifos.out, b"\n")
        assert b"pid1=/bin/busybox sh -c trap" in line
        # the container's rootfs is mounted in the pod's mount namespace (the daemon's;
        # QEMU's own, its jail, gets it from there), not in the host's
        pod_ns, qemu_ns = mount_namespace(pod.daemon_pid), mount_namespace(qemu)
        assert pod_ns not in (None, mount_namespace()) and qemu_ns not in (None, pod_ns)
        assert str(c_bundle / "rootfs") in mounts_under(tmp_path, pod.daemon_pid)
        assert mounts_under(tmp_path) == []
        assert b" host=api-pod\n" in line  # PodSandboxConfig.hostname, in the pod's UTS

        # Grow: 1 CPU and 256 MiB for the pod -> a vCPU and memory hot-plugged, the
        # sandbox cgroup raised
        await update(pod, {"cpu": {"quota": 100_000, "period": 100_000},
                           "memory": {"limit": 256 * MIB}})
        grown = await pod.status()
        plan = info(grown, "plan")
        assert (plan["vcpus"], plan["memory_mib"]) == (2, 256 + 256)
        assert info(grown, "vm") == {"vcpus": 2, "memory_mib": 512}
        assert info(grown, "guest")["online_cpus"] == 2
        quota, memory = host_limits(pod)
        assert int(quota) == plan["cgroup_cpu_quota"] == 200_000  # (1 + 1 guest) CPUs
        assert int(memory) == plan["cgroup_memory_limit"] == (512 + TCG_QEMU_OVERHEAD_MIB) * MIB

        metrics = await pod.call("SandboxMetrics", sb.SandboxMetricsRequest(sandbox_id=pod.id),
                                 sb.SandboxMetricsResponse)
        assert metrics.metrics.id == pod.id and metrics.metrics.timestamp.seconds > 0
        if v2():
            from podvm_core.pb.containerd.cgroups.v2 import metrics_pb2 as v2m

            assert metrics.metrics.data.type_url == "io.containerd.cgroups.v2.Metrics"
            m2 = v2m.Metrics.FromString(metrics.metrics.data.value)
            assert m2.memory.usage_limit == int(memory) and m2.memory.usage > 0
        else:
            from podvm_core.pb.containerd.cgroups.v1 import metrics_pb2 as v1m

            assert metrics.metrics.data.type_url == "io.containerd.cgroups.v1.Metrics"
            m1 = v1m.Metrics.FromString(metrics.metrics.data.value)
            assert m1.memory.usage.limit == int(memory)
            assert m1.memory.usage.usage > 0 and m1.cpu.usage.total > 0
            assert m1.pids.current > 0

        # Refused updates change nothing: one that cannot fit, a disallowed annotation,
        # resources of a type podvm does not take
        with pytest.raises(TtrpcError) as err:
            await update(pod, {"memory": {"limit": 64 * 1024 * MIB}})
        assert err.value.code == Code.RESOURCE_EXHAUSTED
        with pytest.raises(TtrpcError) as err:
            await update(pod, {"cpu": {"quota": 100_000, "period": 100_000},
                               "memory": {"limit": 256 * MIB}},
                         **{"io.katacontainers.config.hypervisor.default_vcpus": "2"})
        assert err.value.code == Code.INVALID_ARGUMENT and "enable_annotations" in \
            err.value.message
        bad = sb.UpdateSandboxRequest(sandbox_id=pod.id)
        bad.resources.type_url = "example.com/Nonsense"
        with pytest.raises(TtrpcError) as err:
            await pod.call("UpdateSandbox", bad, sb.UpdateSandboxResponse)
        assert err.value.code == Code.INVALID_ARGUMENT
        bad.resources.type_url, bad.resources.value = LINUX_RESOURCES, b"{not json"
        with pytest.raises(TtrpcError) as err:
            await pod.call("UpdateSandbox", bad, sb.UpdateSandboxResponse)
        assert err.value.code == Code.INVALID_ARGUMENT
        assert info(await pod.status(), "plan") == plan
        assert host_limits(pod) == (quota, memory)

        # Shrink, as a PodSandboxConfig: no CPU limit any more -> a vCPU offline in the
        # guest (QEMU keeps it present), the cgroup's quota lifted; annotations accepted
        await update(pod, pod.config(memory=256 * MIB), **{"example.com/resized": "yes"})
        shrunk = await pod.status()
        assert info(shrunk, "plan")["vcpus"] == 1
        assert info(shrunk, "guest")["online_cpus"] == 1
        assert info(shrunk, "vm")["vcpus"] == 2
        assert host_limits(pod)[0] in ("-1", "max")

        # Stop with the container still running: it is killed and containerd hears it
        await pod.call("StopSandbox", sb.StopSandboxRequest(sandbox_id=pod.id, timeout_secs=20),
                       sb.StopSandboxResponse)
        waited = await asyncio.wait_for(pod.client.call(
            TASK, "Wait", api.WaitRequest(id="c1"), api.WaitResponse), 60)
        assert waited.exit_status == 137
        async with asyncio.timeout(60):
            while ("/tasks/exit", "containerd.events.TaskExit") not in pod.events:
                await asyncio.sleep(0.1)
        assert ("/tasks/exit", "containerd.events.TaskExit") in pod.events
        sandbox_exit = await pod.call("WaitSandbox", sb.WaitSandboxRequest(sandbox_id=pod.id),
                                      sb.WaitSandboxResponse)
        assert sandbox_exit.exited_at.seconds > 0
        stopped = await pod.status()
        assert (stopped.state, stopped.pid) == ("SANDBOX_NOTREADY", 0)
        assert stopped.exited_at == sandbox_exit.exited_at
        assert not alive(qemu) and not vms(pod.id)
        assert not cgroup_exists(pod.sandbox_cgroup)
        with pytest.raises(TtrpcError) as err:
            await pod.call("PingSandbox", sb.PingRequest(sandbox_id=pod.id), sb.PingResponse)
        assert err.value.code == Code.FAILED_PRECONDITION
        deleted = await pod.client.call(TASK, "Delete", api.DeleteRequest(id="c1"),
                                        api.DeleteResponse)
        assert deleted.exit_status == 137
        # containerd 2.x asks the Task API to shut down once the last task is deleted,
        # before it shuts the sandbox down: the shim stays for the sandbox
        await pod.client.call(TASK, "Shutdown", api.ShutdownRequest(id="c1"), Empty)
        await asyncio.sleep(0.5)
        assert alive(pod.daemon_pid)
        assert (await pod.status()).state == "SANDBOX_NOTREADY"

        # answered before the shim exits: containerd's sandbox controller takes
        # no answer as a failed shutdown
        await pod.call("ShutdownSandbox", sb.ShutdownSandboxRequest(sandbox_id=pod.id),
                       sb.ShutdownSandboxResponse)
        await wait_gone(pod.daemon_pid, timeout=60)
        # nothing left, before any `delete`: socket, state, mounts, the sandbox cgroup
        assert not os.path.exists(pod.address.removeprefix("unix://"))
        assert not os.path.exists(f"/run/podvm/{NS}/{pod.id}")
        assert mounts_under(tmp_path) == []
        # so no mount of the pod is left anywhere
        assert in_mount_namespace(pod_ns) == [] and in_mount_namespace(qemu_ns) == []
        assert not cgroup_exists(pod.sandbox_cgroup)


async def test_a_vm_that_dies_ends_the_sandbox_and_shutdown_cleans_up(tmp_path) -> None:
    """What the shim does when its VM dies is the host's: on a FakeVM (testbed/fakevm.py),
    a real process killed as QEMU would be."""
    async with sandbox_shim(tmp_path, vmm="fake") as pod:
        await pod.create(pod.config(memory=64 * MIB))
        # two Starts at once (a retry racing the first): one VM, the other refused
        results = await asyncio.gather(*(pod.call(
            "StartSandbox", sb.StartSandboxRequest(sandbox_id=pod.id), sb.StartSandboxResponse)
            for _ in range(2)), return_exceptions=True)
        started, = [r for r in results if isinstance(r, sb.StartSandboxResponse)]
        refusal, = [r for r in results if isinstance(r, TtrpcError)]
        assert refusal.code == Code.FAILED_PRECONDITION and "ready" in refusal.message
        assert vms(pod.id) == [started.pid]
        waiting = asyncio.ensure_future(pod.call("WaitSandbox", sb.WaitSandboxRequest(
            sandbox_id=pod.id), sb.WaitSandboxResponse))
        os.kill(started.pid, 9)
        waited = await asyncio.wait_for(waiting, 60)
        assert waited.exit_status == 255 and waited.exited_at.seconds > 0
        assert (await pod.status()).state == "SANDBOX_NOTREADY"
        with pytest.raises(TtrpcError) as err:
            await pod.call("SandboxMetrics", sb.SandboxMetricsRequest(sandbox_id=pod.id),
                           sb.SandboxMetricsResponse)
        assert err.value.code == Code.FAILED_PRECONDITION
        await pod.call("StopSandbox", sb.StopSandboxRequest(sandbox_id=pod.id),
                       sb.StopSandboxResponse)
        assert not cgroup_exists(pod.sandbox_cgroup)
        # answered before the shim exits: containerd's sandbox controller takes
        # no answer as a failed shutdown
        await pod.call("ShutdownSandbox", sb.ShutdownSandboxRequest(sandbox_id=pod.id),
                       sb.ShutdownSandboxResponse)
        await wait_gone(pod.daemon_pid, timeout=60)
        assert not os.path.exists(f"/run/podvm/{NS}/{pod.id}")
