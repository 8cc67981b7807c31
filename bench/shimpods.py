"""Pods for benchmarks: real podvm VMs, each started through its own shim's Task API over
ttrpc as containerd starts one (`start`, Create and Start of the sandbox container, then
workload containers), with no containerd in between. A pod's CPU request and limit
reach the shim as containerd's CRI plugin passes them (the sandbox-cpu annotations); the
pod cgroup above the sandbox cgroup is the caller's (kubelet's in real life).

Every pod of a run lives in the containerd namespace `podvm-bench-<pid>` and its bundles
in a work directory of the same name. `stop` ends a pod through the Task API and then
runs the shim's `delete` (what containerd runs for a shim that is gone), which kills the
daemon and QEMU and removes the pod's cgroups, mounts and state whatever happened;
`sweep_stale` does that for the pods of runs that were killed."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

from podvm_core.pb.containerd.runtimeoptions.v1.api_pb2 import Options
from podvm_core.pb.containerd.services.events.ttrpc.v1 import events_pb2
from podvm_core.pb.containerd.task.v2 import shim_pb2 as api
from podvm_core.pb.containerd.types.mount_pb2 import Mount
from podvm_core.ttrpc import Client, ConnectionClosed, Server, TtrpcError, bind
from shim.host.paths import STATE_ROOT
from testbed.taskshim import EventSink, busybox_rootfs, join_netns, spec

PREFIX = "podvm-bench-"
TASK = "containerd.task.v2.Task"
SHIM = str(pathlib.Path(sys.executable).parent / "containerd-shim-podvm-v2")
CRI = "io.kubernetes.cri."
PERIOD_US = 100_000
SHM_OPTIONS = ["nosuid", "nodev", "mode=1777", "size=65536k"]
"""The container's /dev/shm, as containerd's CRI plugin gives one: where workloads
keep what they measure until they print it (a tmpfs in the guest)."""


def cri_annotations(request: float, limit: float | None) -> dict[str, str]:
    """The pod's totals as containerd's CRI plugin puts them on the sandbox container:
    shares from the request (none: 0), a CFS quota from the limit (none: 0)."""
    return {CRI + "container-type": "sandbox",
            CRI + "sandbox-cpu-shares": str(round(request * 1024)),
            CRI + "sandbox-cpu-quota": str(round(limit * PERIOD_US) if limit else 0),
            CRI + "sandbox-cpu-period": str(PERIOD_US if limit else 0)}


class Run:
    """What the pods of one bench run share: a namespace, a work directory with the
    busybox rootfs, and the events endpoint their shims publish to."""

    def __init__(self) -> None:
        self.namespace = f"{PREFIX}{os.getpid()}"
        self.work = work_dir(os.getpid())
        self.work.mkdir()
        self.rootfs = busybox_rootfs(self.work / "rootfs")
        self.grpc = str(self.work / "containerd.sock")
        self.events = Server([bind(events_pb2.DESCRIPTOR.services_by_name["Events"],
                                   EventSink())])

    async def __aenter__(self) -> Run:
        await self.events.start_path(self.grpc + ".ttrpc")
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.events.close()
        with contextlib.suppress(OSError):  # empty unless a pod's state was kept
            os.rmdir(os.path.join(STATE_ROOT, self.namespace))
        remove_work(self.work)

    def shim(self, pod_id: str, action: str, bundle: pathlib.Path,
             timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(
            [SHIM, "-namespace", self.namespace, "-address", self.grpc, "-publish-binary",
             "/usr/bin/containerd", "-id", pod_id, action], cwd=bundle, capture_output=True,
            timeout=timeout, stdin=subprocess.DEVNULL,
            env=dict(os.environ, TTRPC_ADDRESS=self.grpc + ".ttrpc"))


class Output:
    """A container's stdout as containerd reads it: a FIFO the shim writes to."""

    def __init__(self, path: pathlib.Path) -> None:
        os.mkfifo(path)
        self.path = path
        self.fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        self.data = b""

    async def until(self, marker: bytes, timeout: float) -> bytes:
        """Everything read once `marker` has been; TimeoutError with what came."""
        try:
            async with asyncio.timeout(timeout):
                while marker not in self.data:
                    try:
                        chunk = os.read(self.fd, 1 << 16)
                    except BlockingIOError:
                        chunk = b""
                    if chunk:
                        self.data += chunk
                    else:
                        await asyncio.sleep(0.01)
        except TimeoutError:
            raise TimeoutError(f"no {marker!r} within {timeout:g}s; the container said "
                               f"{self.data[-600:]!r}") from None
        return self.data

    def close(self) -> None:
        os.close(self.fd)


class Pod:
    """One pod: its shim daemon, the sandbox container, the client containerd holds."""

    def __init__(self, run: Run, pod_id: str, bundle: pathlib.Path) -> None:
        self.run, self.id, self.bundle = run, pod_id, bundle
        self.client: Client | None = None
        self.options = api.CreateTaskRequest().options
        self.containers: list[str] = []

    @classmethod
    async def start(cls, run: Run, pod_id: str, config: pathlib.Path, pod_cgroup: str,
                    annotations: dict[str, str], netns: str = "") -> Pod:
        """The pod booted: `config` is its podvm configuration file, `pod_cgroup` the
        cgroup its sandbox cgroup goes under, `netns` the network namespace CNI would
        have made (none: one of its own without interfaces). On failure the pod is
        stopped and the error says what the shim logged."""
        bundle = run.work / pod_id
        (bundle / "rootfs").mkdir(parents=True, exist_ok=True)  # exists: a second try
        sandbox = spec(["sleep", "2147483647"])
        sandbox["annotations"] = dict(annotations, **{CRI + "sandbox-id": pod_id})
        sandbox["linux"]["cgroupsPath"] = f"{pod_cgroup}/{pod_id}"
        join_netns(sandbox, netns)
        (bundle / "config.json").write_text(json.dumps(sandbox))
        (bundle / "log").touch()  # the daemon logs here (containerd gives it a FIFO)
        pod = cls(run, pod_id, bundle)
        pod.options.Pack(Options(config_path=str(config)))
        try:
            started = run.shim(pod_id, "start", bundle)
            if started.returncode != 0:
                raise RuntimeError(f"pod {pod_id}: shim start failed: "
                                   f"{started.stderr.decode().strip()}")
            pod.client = await Client.connect(
                started.stdout.decode(), metadata=[("containerd-namespace-ttrpc",
                                                    run.namespace)])
            await pod._create(pod_id, bundle)
            await pod.call("Start", api.StartRequest(id=pod_id), api.StartResponse)
        except BaseException as exc:
            log = pod.log_tail()
            await pod.stop()
            if isinstance(exc, (TtrpcError, RuntimeError)):
                raise RuntimeError(f"pod {pod_id} did not boot: {exc}; shim log: "
                                   f"{log}") from None
            raise
        return pod

    def log_tail(self, lines: int = 8) -> str:
        with contextlib.suppress(OSError):
            return " | ".join((self.bundle / "log").read_text().splitlines()[-lines:])
        return "(none)"

    async def call(self, method: str, request, response=api.StateResponse):
        assert self.client is not None
        return await self.client.call(TASK, method, request, response)

    async def _create(self, cid: str, bundle: pathlib.Path, stdout: str = "") -> None:
        req = api.CreateTaskRequest(id=cid, bundle=str(bundle), stdout=stdout, stderr=stdout,
                                    rootfs=[Mount(type="bind", source=str(self.run.rootfs),
                                                  options=["rbind", "rw"])])
        req.options.CopyFrom(self.options)
        await self.call("Create", req, api.CreateTaskResponse)

    async def start_container(self, cid: str, script: str) -> Output:
        """A container of the pod running `sh -c script`, started; its stdout."""
        bundle = self.bundle.parent / f"{self.id}-{cid}"
        (bundle / "rootfs").mkdir(parents=True)
        container = spec(["sh", "-c", script])
        container["annotations"] = {CRI + "sandbox-id": self.id,
                                    CRI + "container-type": "container"}
        container["mounts"].append({"destination": "/dev/shm", "type": "tmpfs",
                                    "source": "shm", "options": SHM_OPTIONS})
        (bundle / "config.json").write_text(json.dumps(container))
        out = Output(bundle.parent / f"{self.id}-{cid}.stdout")
        await self._create(cid, bundle, stdout=str(out.path))
        self.containers.append(cid)
        await self.call("Start", api.StartRequest(id=cid), api.StartResponse)
        return out

    async def remove(self, cid: str, out: Output) -> None:
        """The container killed (if it still runs) and deleted."""
        with contextlib.suppress(TtrpcError):
            await self.call("Kill", api.KillRequest(id=cid, signal=9, all=True))
        await self.call("Wait", api.WaitRequest(id=cid), api.WaitResponse)
        await self.call("Delete", api.DeleteRequest(id=cid), api.DeleteResponse)
        self.containers.remove(cid)
        out.close()

    async def stop(self) -> None:
        """Shut down through the Task API (a bounded try), then `delete` as containerd
        runs it for a gone shim: nothing of the pod is left either way."""
        if self.client is not None:
            with contextlib.suppress(TtrpcError, ConnectionClosed, OSError, TimeoutError):
                async with asyncio.timeout(60):
                    await self.call("Kill", api.KillRequest(id=self.id, signal=9, all=True))
                    await self.call("Wait", api.WaitRequest(id=self.id), api.WaitResponse)
                    await self.call("Delete", api.DeleteRequest(id=self.id),
                                    api.DeleteResponse)
                    await self.call("Shutdown", api.ShutdownRequest(id=self.id))
            await self.client.close()
            self.client = None
        self.delete()

    def delete(self) -> None:
        """Synchronous, so that it also runs while the event loop is being torn down."""
        done = self.run.shim(self.id, "delete", self.bundle)
        if done.returncode != 0:
            print(f"pod {self.id}: shim delete: {done.stderr.decode().strip()}",
                  file=sys.stderr)


def work_dir(pid: int) -> pathlib.Path:
    return pathlib.Path(tempfile.gettempdir()) / f"{PREFIX}{pid}"


def remove_work(work: pathlib.Path) -> None:
    """A run's bundles: rootfs binds a killed shim left are unmounted first, so that
    removing the tree never reaches through one."""
    from shim.host.mounts import unmount_all

    if work.exists():
        unmount_all(str(work))
        shutil.rmtree(work, ignore_errors=True)


def stale_pids() -> set[int]:
    """Bench runs that were killed: their pid is gone, their namespace or work is left."""
    names = os.listdir(tempfile.gettempdir())
    with contextlib.suppress(FileNotFoundError):
        names += os.listdir(STATE_ROOT)
    return {int(pid) for name in names if name.startswith(PREFIX)
            and (pid := name.removeprefix(PREFIX)).isdigit()
            and not os.path.exists(f"/proc/{pid}")}


def sweep_stale() -> list[str]:
    """The pods of killed runs removed by the shim's own cleanup (daemon, QEMU, mounts,
    cgroups, state), and their work directories; the pod ids swept."""
    from shim.host.cleanup import cleanup_container

    swept = []
    for pid in sorted(stale_pids()):
        namespace, work = f"{PREFIX}{pid}", work_dir(pid)
        state = os.path.join(STATE_ROOT, namespace)
        with contextlib.suppress(FileNotFoundError):
            for pod_id in os.listdir(state):
                cleanup_container(namespace, pod_id, str(work / pod_id))
                swept.append(pod_id)
        with contextlib.suppress(OSError):
            os.rmdir(state)
        remove_work(work)
    return swept
