"""One pod of bench/scale.py under either runtime, podvm or runc: kubelet's calls that start
it and remove it, made and timed from this process, what the host holds for it while it
runs, and what its removal left (it must be nothing).

What a pod must not leave is taken from the pod while it runs (its cgroups, runc's state,
its task bundles): a place that never held the pod would prove nothing by being empty, so a
running pod without them is an error of the bench."""
from __future__ import annotations

import os
import pathlib
import time
from dataclasses import dataclass, field

from google.protobuf import json_format

import cgroups
from bench.pod_bench import annotations
from podvm_core.pb.cri import api_pb2 as cri
from podvm_node.collect import Reader
from shim.host import paths
from shim.host.podstate import PodState, PodStateError, state_path
from testbed.containerd import CRI_NAMESPACE, Containerd, cgroup_dirs, mounts_under, shims_of
from testbed.criclient import CriClient
from testbed.pods import container_config, pod_config, podvm_leftovers, qemus

TASK_BUNDLES = "io.containerd.runtime.v2.task"
"""containerd's directory (in its state) of the task bundles, one per pod and container."""


@dataclass
class PodRun:
    name: str
    shape: tuple[int, int]
    runtime: str = "podvm"
    pod_id: str = ""
    container_id: str = ""
    ready_s: float = 0.0
    """RunPodSandbox's call to its return: the pod is ready."""
    running_s: float = 0.0
    """RunPodSandbox's call to StartContainer's return: its container runs."""
    error: str = ""
    memory_bytes: int | None = None
    removed_s: float = 0.0
    """Its StopPodSandbox's call to its RemovePodSandbox's return."""
    stop_called: float = 0.0
    removed_at: float = 0.0
    """time.monotonic() of that call and of that return."""
    cgroups: list[str] = field(default_factory=list)
    held: list[str] = field(default_factory=list)
    """Other directories the pod had while it ran (runc's state, the task bundles)."""

    @property
    def ids(self) -> list[str]:
        return [i for i in (self.pod_id, self.container_id) if i]


def start_pod(client: CriClient, ctd: Containerd, work: pathlib.Path, pod: PodRun) -> None:
    """What kubelet does for a new pod: its sandbox, then its one container (a long sleep
    in the test image), started. A podvm pod takes its shape by Kata's sizing annotations;
    a runc pod has no use for them."""
    extra = {"annotations": annotations(pod.shape)} if pod.runtime == "podvm" else {}
    config = json_format.ParseDict(pod_config(ctd, work, pod.name, **extra),
                                   cri.PodSandboxConfig(), ignore_unknown_fields=True)
    container = json_format.ParseDict(container_config(pod.name, "exec sleep 100000"),
                                      cri.ContainerConfig(), ignore_unknown_fields=True)
    started = time.monotonic()
    try:
        pod.pod_id = client.runtime("RunPodSandbox", cri.RunPodSandboxRequest(
            config=config, runtime_handler=pod.runtime)).pod_sandbox_id
        pod.ready_s = time.monotonic() - started
        pod.container_id = client.runtime("CreateContainer", cri.CreateContainerRequest(
            pod_sandbox_id=pod.pod_id, config=container, sandbox_config=config)).container_id
        client.runtime("StartContainer",
                       cri.StartContainerRequest(container_id=pod.container_id))
        pod.running_s = time.monotonic() - started
    except Exception as exc:  # noqa: BLE001 - every pod's outcome is reported
        pod.error = f"{type(exc).__name__}: {exc}"


def check_running(client: CriClient, pod: PodRun) -> None:
    """A started pod must read SANDBOX_READY and its container CONTAINER_RUNNING."""
    if pod.error:
        return
    sandbox = client.runtime("PodSandboxStatus",
                             cri.PodSandboxStatusRequest(pod_sandbox_id=pod.pod_id))
    status = client.runtime("ContainerStatus",
                            cri.ContainerStatusRequest(container_id=pod.container_id))
    if sandbox.status.state != cri.SANDBOX_READY:
        pod.error = f"sandbox state {cri.PodSandboxState.Name(sandbox.status.state)}"
    elif status.status.state != cri.CONTAINER_RUNNING:
        pod.error = f"container state {cri.ContainerState.Name(status.status.state)}"


def measure_pod(ctd: Containerd, reader: Reader, pod: PodRun) -> None:
    """What the running pod holds on the host: the memory charged to it (podvm: its
    sandbox cgroup), and the directories that must be gone after its removal."""
    if not pod.pod_id:
        return
    pod.held = [str(ctd.state / TASK_BUNDLES / CRI_NAMESPACE / i) for i in pod.ids]
    if pod.runtime == "podvm":
        measure_podvm(reader, pod)
    else:
        measure_runc(ctd, pod)
    if not pod.error:
        missing = [d for d in pod.held if not os.path.isdir(d)]
        if missing or not pod.cgroups:
            pod.error = ("bench: the running pod has not " + ", ".join(
                missing or ["a cgroup"]) + ": its leftover check would prove nothing")


def measure_podvm(reader: Reader, pod: PodRun) -> None:
    state_dir = paths.state_dir(CRI_NAMESPACE, pod.pod_id)
    found = reader.read(state_dir)
    pod.memory_bytes = found.memory_bytes if found is not None else None
    try:
        state = PodState.load(state_path(state_dir))
    except (OSError, PodStateError):
        return
    manager = cgroups.manager_from_state(dict(state.cgroup.manager))
    hierarchies = getattr(manager, "hierarchies", None) or [manager.hierarchy]
    pod.cgroups = [h.directory(state.cgroup.layout.sandbox) for h in hierarchies]


def measure_runc(ctd: Containerd, pod: PodRun) -> None:
    """containerd's CRI puts each of a runc pod's containers (its pause one included) in
    the cgroup <cgroup_parent>/<id> (cgroupfs), and runc keeps its state under the runtime's
    Root, per namespace (testbed/containerd.py)."""
    parent = ctd.cgroup_parent.strip("/")
    pod.cgroups = [d for i in pod.ids for d in cgroup_dirs(f"{parent}/{i}")]
    pod.held += [str(ctd.state / "runc" / CRI_NAMESPACE / i) for i in pod.ids]
    for directory in pod.cgroups:  # the memory hierarchy's (v1), or the unified one's
        for name in ("memory.usage_in_bytes", "memory.current"):
            usage = pathlib.Path(directory, name)
            if usage.exists():
                pod.memory_bytes = (pod.memory_bytes or 0) + int(usage.read_text())


def remove_pod(client: CriClient, pod: PodRun, tries: int = 3) -> str:
    """StopPodSandbox and RemovePodSandbox, tried again after a failure as kubelet does;
    the errors, if any (reported even when a later try removed the pod)."""
    if not pod.pod_id:
        return ""
    pod.stop_called = time.monotonic()
    errors = []
    for _ in range(tries):
        try:
            client.runtime("StopPodSandbox",
                           cri.StopPodSandboxRequest(pod_sandbox_id=pod.pod_id))
            client.runtime("RemovePodSandbox",
                           cri.RemovePodSandboxRequest(pod_sandbox_id=pod.pod_id))
            break
        except Exception as exc:  # noqa: BLE001
            errors.append(f"{pod.name}: {type(exc).__name__}: {exc}")
    pod.removed_at = time.monotonic()
    pod.removed_s = pod.removed_at - pod.stop_called
    return "; ".join(errors)


def removal_wall(pods: list[PodRun]) -> float:
    """The removal of all of them at once: the first StopPodSandbox's call to the last
    RemovePodSandbox's return."""
    removed = [p for p in pods if p.pod_id]
    if not removed:
        return 0.0
    return max(p.removed_at for p in removed) - min(p.stop_called for p in removed)


def pod_leftovers(ctd: Containerd, pod: PodRun) -> list[str]:
    """What the removed pod left: its shim, its mounts, its cgroups, the directories it
    held; for podvm also QEMU, virtiofsd, the shim's state and socket."""
    if not pod.pod_id:
        return []
    if pod.runtime == "podvm":
        left = podvm_leftovers(ctd, pod.pod_id)
    else:
        left = [f"shim {cmd}" for _, cmd in shims_of(ctd.address) if pod.pod_id in cmd]
        left += [f"mount {m}" for m in mounts_under(ctd.workdir)
                 if any(i in m for i in pod.ids)]
    left += [f"cgroup {d}" for d in pod.cgroups if os.path.isdir(d)]
    left += [f"directory {d}" for d in pod.held if os.path.isdir(d)]
    return left


def leftovers(ctd: Containerd, pods: list[PodRun], timeout: float = 120) -> list[str]:
    """What the removed pods left (waiting up to `timeout` for their shims to exit), and
    any pod QEMU of this containerd."""
    deadline = time.monotonic() + timeout
    while True:
        left = [f"{pod.name}: {what}" for pod in pods for what in pod_leftovers(ctd, pod)]
        left += [f"qemu {pid}" for pid in qemus(ctd.cgroup_parent)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)
