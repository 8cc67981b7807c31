"""The node's disk reserve through containerd's CRI (issue 44): a pod whose scratch disk
does not fit in the free space less what the running pods' disks may still take less
`scratch_reserve_mib` is refused at runp, before its VM boots, with a message naming the
disk, and leaves nothing; a running pod's disk counts against the next. What only the
host shows: FakeVM (testbed/fakevm.py), no guest."""
from __future__ import annotations

import json
import os

import pytest

from shim.config import HypervisorConfig
from shim.host import diskreserve
from shim.resources.storage import ANNOTATION, EXT4_FIXED_MIB, EXT4_METADATA_PERCENT
from testbed.cri import Crictl, write_config
from testbed.pods import pod_config

from .test_podvm_pods import cri_containerd, remove_pod, running, runp_refused

MIB = 1 << 20
RESERVE_MIB = HypervisorConfig.scratch_reserve_mib


@pytest.fixture(scope="module")
def fake_ctd(tmp_path_factory, image_cache):
    yield from cri_containerd(tmp_path_factory, image_cache, "podvm-reserve-fake",
                              "podvm-reserve-test", vmm="fake")


def room_mib(ctd) -> tuple[int, int]:
    """(free MiB on the scratch file system, MiB a new pod's disk may have): the free space
    less what running pods' disks (other tests' too) may still take, less the reserve."""
    with open(ctd.podvm_config) as f:
        scratch = next(line.split('"')[1] for line in f if line.startswith("scratch_path"))
    os.makedirs(scratch, exist_ok=True)
    fs = os.statvfs(scratch)
    free = fs.f_bavail * fs.f_frsize
    claimed = sum(c.may_still_take for c in diskreserve.claims(os.stat(scratch).st_dev))
    return free // MIB, (free - claimed) // MIB - RESERVE_MIB


def limit_for(disk_mib: int) -> int:
    """The container limit (bytes) whose disk is about `disk_mib` (storage.py's sizing)."""
    return (disk_mib - EXT4_FIXED_MIB) * 100 // (100 + EXT4_METADATA_PERCENT) * MIB


def storage(container_bytes: int) -> dict:
    return {"annotations": {ANNOTATION: json.dumps({"containers": {"c": container_bytes}})}}


def test_a_pod_beyond_the_free_space_less_the_reserve_is_refused(fake_ctd, tmp_path) -> None:
    crictl = Crictl(fake_ctd.cri_endpoint, timeout="120s")
    before = running(fake_ctd)
    # more than the file system has free
    free, room = room_mib(fake_ctd)
    message = runp_refused(crictl, fake_ctd, tmp_path, "huge", **storage(free * MIB))
    assert "the pod needs a scratch disk of" in message and "MiB free" in message, message
    assert running(fake_ctd) == before
    # free, but not with the reserve kept
    message = runp_refused(crictl, fake_ctd, tmp_path, "reserve",
                           **storage(limit_for(room + RESERVE_MIB // 2)))
    assert f"less the {RESERVE_MIB} MiB reserve (scratch_reserve_mib)" in message, message
    assert running(fake_ctd) == before
    # a running pod's disk claims its room: what fits alone is refused beside it
    half = storage(limit_for(room_mib(fake_ctd)[1] * 6 // 10))
    first = crictl.runp(write_config(tmp_path, "pod-first.json", pod_config(
        fake_ctd, tmp_path, "first", **half)), runtime="podvm")
    try:
        message = runp_refused(crictl, fake_ctd, tmp_path, "second", **half)
        assert "the pod needs a scratch disk of" in message, message
    finally:
        remove_pod(crictl, first)
    assert running(fake_ctd) == before
