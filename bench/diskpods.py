"""Pods for bench/disk_bench.py, runc's and podvm's alike, through containerd's CRI from
this process (one gRPC connection, as kubelet calls), and what the host holds of what
their containers write: the disk a write took on the host, and what kubelet reads of it.

Where kubelet looks, by runtime:
- runc: a container's root is its overlay upper directory on the host, which containerd
  measures for the CRI's ContainerStats (writable_layer, refreshed every
  `stats_collect_period`, 10 s by default); an emptyDir is its host directory, which
  kubelet measures itself (du).
- podvm: both are on the pod's scratch disk, an unnamed file QEMU holds; the shim links it
  into the pod's log directory, whose files kubelet counts in the pod's ephemeral storage
  by the blocks they hold (shim/host/podlogdisk.py). ContainerStats' writable_layer is
  containerd's snapshotter's, which a VM pod's writes never reach."""
from __future__ import annotations

import json
import os
import pathlib
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

from google.protobuf import json_format

from podvm_core.pb.cri import api_pb2 as cri
from shim.host import diskreserve, paths
from shim.host.podstate import PodState, state_path
from testbed.containerd import CRI_NAMESPACE, Containerd
from testbed.criclient import CriClient
from testbed.kubeletdirs import volume_dir
from testbed.pods import container_config, pod_config

CALL_TIMEOUT = 120.0
EMPTY_DIR = "/empty"
STATS_PERIOD_S = 10.0
"""One stats period: containerd's stats_collect_period and kubelet's eviction monitoring
interval (both 10 s by default)."""


@dataclass
class Pod:
    runtime: str
    pod_id: str
    container_id: str
    log_directory: pathlib.Path
    empty_dir: pathlib.Path | None
    """The emptyDir's host directory, as kubelet makes it (None: the pod has none)."""


@dataclass(frozen=True)
class Write:
    """One dd in a container."""
    seconds: float
    """In the container: busybox adjtimex before and after dd (busybox dd prints no time)."""
    wall_s: float
    """The ExecSync call from this process, exec's own cost included."""
    exit_code: int
    size: int
    """The written file's size afterwards."""
    error: str
    """dd's complaint ("" when it had none)."""


def dd_script(path: str, mib: int | None) -> str:
    """dd from /dev/zero into `path`, 1 MiB blocks, `conv=fsync` (busybox's dd: its data
    on the disk before it returns), `mib` MiB or (None) until the disk says no; timed."""
    count = f" count={mib}" if mib is not None else ""
    return (f"adjtimex; dd if=/dev/zero of={path} bs=1M{count} conv=fsync 2>&1; "
            f"echo rc=$?; adjtimex; stat -c size=%s {path}")


def parse_write(output: str, wall_s: float) -> Write:
    stamps, sec = [], None
    for line in output.splitlines():
        words = line.split()
        if line.strip().startswith("time.tv_sec:"):
            sec = int(words[-1])
        elif line.strip().startswith("time.tv_usec:") and sec is not None:
            stamps.append(sec + int(words[-1]) / 1e6)
    rc, size = re.search(r"^rc=(\d+)$", output, re.M), re.search(r"^size=(\d+)$", output, re.M)
    if len(stamps) != 2 or rc is None or size is None:
        raise RuntimeError(f"the timed dd printed {output[-800:]!r}")
    error = " ".join(line.strip() for line in output.splitlines()
                     if line.startswith("dd:"))
    return Write(stamps[1] - stamps[0], wall_s, int(rc[1]), int(size[1]), error)


def du(path: pathlib.Path) -> int:
    """The bytes every file under `path` holds (blocks, as du and kubelet count them)."""
    total = 0
    for top, dirs, files in os.walk(path):
        for name in dirs + files:
            try:
                total += os.lstat(os.path.join(top, name)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


def first_seen(read: Callable[[], int], wanted: int, within_s: float = STATS_PERIOD_S,
               step_s: float = 0.25) -> tuple[float | None, int]:
    """(seconds until `read()` reached `wanted`, or None if it did not within `within_s`;
    its last value)."""
    started = time.monotonic()
    while True:
        value = read()
        waited = time.monotonic() - started
        if value >= wanted:
            return waited, value
        if waited >= within_s:
            return None, value
        time.sleep(step_s)


class DiskPods:
    """One pod at a time with one container (a sleep in the busybox test image); the pods'
    log directories under `logs` (on the scratch disks' file system: podvm links each disk
    there), their emptyDirs under `kubelet` (kubelet's root, on a disk)."""

    def __init__(self, ctd: Containerd, logs: pathlib.Path, kubelet: pathlib.Path) -> None:
        self.ctd, self.logs, self.kubelet = ctd, logs, kubelet
        self.client = CriClient(ctd.cri_endpoint, timeout=CALL_TIMEOUT)

    def start(self, runtime: str, name: str, annotations: dict[str, str] | None = None,
              empty_dir: bool = False) -> Pod:
        pod = pod_config(self.ctd, self.logs, name,
                         **({"annotations": annotations} if annotations else {}))
        config = json_format.ParseDict(pod, cri.PodSandboxConfig(), ignore_unknown_fields=True)
        host_dir = volume_dir(self.kubelet, name) if empty_dir else None
        container = dict(container_config("c", "exec sleep 100000"), mounts=[
            {"container_path": EMPTY_DIR, "host_path": str(host_dir)}] if host_dir else [])
        pod_id = self.client.runtime("RunPodSandbox", cri.RunPodSandboxRequest(
            config=config, runtime_handler=runtime)).pod_sandbox_id
        try:
            cid = self.client.runtime("CreateContainer", cri.CreateContainerRequest(
                pod_sandbox_id=pod_id, sandbox_config=config, config=json_format.ParseDict(
                    container, cri.ContainerConfig(), ignore_unknown_fields=True))).container_id
            self.client.runtime("StartContainer", cri.StartContainerRequest(container_id=cid))
        except BaseException:
            self.remove_id(pod_id)
            raise
        return Pod(runtime, pod_id, cid, pathlib.Path(pod["log_directory"]), host_dir)

    def remove(self, pod: Pod) -> None:
        self.remove_id(pod.pod_id)

    def remove_id(self, pod_id: str) -> None:
        self.client.runtime("StopPodSandbox", cri.StopPodSandboxRequest(pod_sandbox_id=pod_id))
        self.client.runtime("RemovePodSandbox",
                            cri.RemovePodSandboxRequest(pod_sandbox_id=pod_id))

    def shell(self, pod: Pod, script: str, timeout_s: int = 600) -> tuple[int, str, float]:
        """(exit code, stdout and stderr, seconds) of `sh -c script` in the container."""
        started = time.monotonic()
        done = self.client.runtime("ExecSync", cri.ExecSyncRequest(
            container_id=pod.container_id, cmd=["sh", "-c", script], timeout=timeout_s),
            timeout=timeout_s + 60)
        return (done.exit_code, (done.stdout + done.stderr).decode(errors="replace"),
                time.monotonic() - started)

    def write(self, pod: Pod, path: str, mib: int | None) -> Write:
        _, output, wall_s = self.shell(pod, dd_script(path, mib))
        return parse_write(output, wall_s)

    def writable_layer(self, pod: Pod) -> int:
        """The container's writable layer as the CRI's ContainerStats gives it to kubelet."""
        stats = self.client.runtime("ContainerStats", cri.ContainerStatsRequest(
            container_id=pod.container_id)).stats
        return stats.writable_layer.used_bytes.value

    def upper_dir(self, pod: Pod) -> pathlib.Path:
        """runc: the container's overlay upper directory, from its root's mount options."""
        status = self.client.runtime("ContainerStatus", cri.ContainerStatusRequest(
            container_id=pod.container_id, verbose=True))
        pid = json.loads(status.info["info"])["pid"]
        for line in pathlib.Path(f"/proc/{pid}/mountinfo").read_text().splitlines():
            fields, _, fs = line.partition(" - ")
            if fields.split()[4] == "/" and fs.startswith("overlay "):
                options = dict(o.partition("=")[::2] for o in fs.split()[2].split(","))
                return pathlib.Path(options["upperdir"])
        raise RuntimeError(f"no overlay root in /proc/{pid}/mountinfo")

    def scratch_bytes(self, pod: Pod) -> int:
        """podvm: the blocks the pod's scratch disk holds on the host, read through its
        QEMU's descriptor of the unnamed file."""
        state = PodState.load(state_path(paths.state_dir(CRI_NAMESPACE, pod.pod_id)))
        disk = diskreserve.of_pod(state, None)
        if disk is None:
            raise RuntimeError(f"pod {pod.pod_id[:13]}: no scratch disk held by QEMU "
                               f"{state.qemu_pid}")
        return disk.st_blocks * 512

    def close(self) -> None:
        self.client.close()
