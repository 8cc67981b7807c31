"""A pod's scratch disk is its own size (issue 44): the ephemeral-storage limits
podvm-webhook annotates (storage.podvm.io/limits) size it, the guest sees ENOSPC past
it, and the host file behind it never takes more. One pod through containerd's CRI,
real QEMU (TCG): what only a guest shows."""
from __future__ import annotations

import json
import os
import tomllib

import pytest

from podvmctl import status
from shim.host import diskreserve, paths, podlogdisk
from shim.host.podstate import PodState, state_path
from shim.resources.storage import ANNOTATION
from testbed.containerd import CRI_NAMESPACE
from testbed.cri import Crictl, write_config
from testbed.pods import container_config, pod_config, pod_qemus

from .test_pod_resources import remove_pod, start_containerd

MIB = 1 << 20


@pytest.fixture(scope="module")
def ctd(tmp_path_factory, image_cache):
    c = start_containerd(tmp_path_factory.mktemp("podvm-disk"), image_cache, {})
    try:
        yield c
    finally:
        c.stop()


def test_a_200mi_pod_cannot_write_300mi_and_its_disk_is_bounded(ctd, tmp_path) -> None:
    crictl = Crictl(ctd.cri_endpoint, timeout="120s")
    pod = pod_config(ctd, tmp_path, "disk200")
    pod["annotations"] = {ANNOTATION: json.dumps({"containers": {"c": 200 * MIB}})}
    pod_file = write_config(tmp_path, "disk200-pod.json", pod)
    pod_id = crictl.runp(pod_file, runtime="podvm")
    try:
        started = {}
        for name in ("c", "w"):
            started[name] = crictl.create(pod_id, write_config(
                tmp_path, f"disk200-{name}.json", container_config(name, "sleep 1000")),
                pod_file)
            crictl.start(started[name])
        state = PodState.load(state_path(paths.state_dir(CRI_NAMESPACE, pod_id)))
        assert state.plan.disk_mib == 204 + 16  # ceil(200 * 1.02) + 16: ext4's own
        assert any(line.startswith("scratch disk 220 MiB") for line in state.plan.explanation)
        # "c", limited to 200Mi, fills its limit (its quota in the guest, or the disk)
        wrote = fill(crictl, started["c"])
        assert "rc=1" in wrote.stdout and ("Disk quota exceeded" in wrote.stdout or
                                           "No space left on device" in wrote.stdout), wrote
        assert 199 * MIB <= int(wrote.stdout.split()[-1]) < 300 * MIB, wrote
        removed = crictl.exec(started["c"], "rm", "/fill")
        assert removed.exit_code == 0, removed
        # "w", which the annotation does not name (no quota of its own), meets the disk:
        # 200Mi of files fit on it (ext4's share is on top), 300Mi do not, ENOSPC
        wrote = fill(crictl, started["w"])
        assert "No space left on device" in wrote.stdout and "rc=1" in wrote.stdout, wrote
        written = int(wrote.stdout.split()[-1])
        assert 200 * MIB <= written < 220 * MIB, wrote
        # on the host: the disk is the pod's size, and takes no more than that
        scratch = _scratch_path(ctd.podvm_config)
        state = PodState.load(state_path(paths.state_dir(CRI_NAMESPACE, pod_id)))
        assert state.qemu_pid == pod_qemus(pod_id)[0] and state.scratch_inode
        disk = diskreserve.scratch_file(state.qemu_pid, state.scratch_inode,
                                        os.stat(scratch).st_dev)
        assert disk is not None and disk.st_size == 220 * MIB
        assert written <= disk.st_blocks * 512 <= 220 * MIB
        report = status.collect(status.find(pod_id, CRI_NAMESPACE))  # what operators see
        assert report["disk"]["size_bytes"] == 220 * MIB and report["differences"] == []
        assert "scratch disk: 220 MiB, holding" in status.render(report)
        # where kubelet looks: the disk's name in the pod's log directory, counted by the
        # blocks it holds (kubelet's getPodLogStats: a du of the directory's own files)
        shown = os.path.join(pod["log_directory"], podlogdisk.name_for(pod_id))
        assert os.stat(shown).st_ino == state.scratch_inode
        assert written <= _du(pod["log_directory"]) <= 221 * MIB
        again = crictl.exec(started["w"], "sh", "-c", "rm /fill && echo ok > /after && "
                            "cat /after")
        assert again.exit_code == 0 and again.stdout.strip() == "ok", again
    finally:
        remove_pod(ctd, crictl, pod_id)
    assert not os.path.exists(shown)  # gone with the pod: its blocks are free again


def fill(crictl: Crictl, cid: str):
    """300 MiB written into the container's root until it fails; the bytes it holds."""
    return crictl.exec(cid, "sh", "-c", "dd if=/dev/zero of=/fill bs=1M count=300 2>&1; "
                       "echo rc=$?; sync; stat -c %s /fill", timeout=300)


def _du(directory: str) -> int:
    return sum(os.stat(os.path.join(directory, name)).st_blocks * 512
               for name in os.listdir(directory))


def _scratch_path(config: str | None) -> str:
    assert config is not None
    with open(config, "rb") as f:
        return tomllib.load(f)["hypervisor"]["qemu"]["scratch_path"]
