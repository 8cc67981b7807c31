"""The agent's side of per-container and per-emptyDir disk limits (guest/agent/quota.py)
that this machine's kernel can hold: the annotation read as the webhook writes it and
refused when malformed, and a limit refused on a disk without project quotas with
nothing left half made. This machine's kernel mounts no ext4 with quotas (no CONFIG_QFMT_V2), so the limits themselves are seen in a
pod (tests/e2e/test_disk_limits.py)."""
from __future__ import annotations

import json
import os
import subprocess

import pytest

from guest.agent import quota, volumes
from podvm_core.ttrpc import Code, TtrpcError
from shim.vm import scratchdisk
from testbed.prereqs import require_tool
from tests.guest.conftest import Dir

WEBHOOKS = {"containers": {"app": 104857600, "zero": 0}, "emptyDirs": {"cache": 52428800},
            "unbounded": ["container:sidecar", "emptyDir:tmp"]}


def spec(value: object, name: str | None = "app") -> dict:
    annotations = {quota.ANNOTATION: value if isinstance(value, str) else json.dumps(value)}
    if name is not None:
        annotations[quota.CONTAINER_NAME] = name
    return {"annotations": annotations}


def test_each_container_reads_its_own_limit_and_the_pod_s_empty_dirs() -> None:
    assert quota.limits(spec(WEBHOOKS)) == (104857600, {"cache": 52428800})
    assert quota.limits(spec(WEBHOOKS, "zero")) == (0, {"cache": 52428800})
    assert quota.limits(spec(WEBHOOKS, "sidecar")) == (None, {"cache": 52428800})
    assert quota.limits(spec(WEBHOOKS, None)) == (None, {"cache": 52428800})  # ctr run
    assert quota.limits({"annotations": {}}) == (None, {})
    assert quota.limits({}) == (None, {})


@pytest.mark.parametrize("bad", [
    "{", "[]", {"containers": {"app": -1}}, {"containers": {"app": "100Mi"}},
    {"containers": {"app": True}}, {"containers": {"app": 1.5}}, {"emptyDirs": []},
    {"pods": {}}])
def test_a_malformed_annotation_refuses_the_container(bad) -> None:
    with pytest.raises(TtrpcError) as err:
        quota.limits(spec(bad))
    assert err.value.code == Code.INVALID_ARGUMENT and quota.ANNOTATION in err.value.message


@pytest.fixture
def no_project_dir(tmp_path) -> int:
    """A directory of this machine's file system, which holds no project ids."""
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    yield fd
    os.close(fd)


def test_a_disk_without_project_quotas_takes_no_limit(no_project_dir) -> None:
    quota.new_project(no_project_dir, None, "container a", ())  # counted only: no error
    with pytest.raises(TtrpcError) as err:
        quota.new_project(no_project_dir, 1 << 20, "container a", ())
    assert err.value.code == Code.FAILED_PRECONDITION
    assert "container a" in err.value.message and "project quotas" in err.value.message


def test_an_empty_dir_whose_limit_cannot_be_set_is_not_left_made(volumes_root) -> None:
    with pytest.raises(TtrpcError) as err:
        volumes.make([Dir("cache"), Dir("cache/sub")], {"cache": 1 << 20})
    assert "emptyDir cache" in err.value.message
    assert list(volumes_root.iterdir()) == []
    volumes.make([Dir("cache"), Dir("cache/sub")], {"other": 1 << 20})  # none of its own
    assert (volumes_root / "cache" / "sub").is_dir()


def test_the_blank_keeps_project_quotas_only(tmp_path) -> None:
    """What the agent's `prjquota` mount needs of the disk: the project feature and its
    hidden quota inode; no user or group quotas to keep up to date on every write."""
    require_tool("mke2fs", "e2fsprogs")
    image = tmp_path / "blank.ext4"
    image.write_bytes(b"")
    os.truncate(image, 128 << 20)
    subprocess.run(["mke2fs", *scratchdisk._MKE2FS_ARGS, str(image)], check=True)
    said = subprocess.run(["dumpe2fs", "-h", str(image)], capture_output=True, text=True,
                          check=True).stdout
    features = said.split("Filesystem features:")[1].split("\n")[0].split()
    assert "quota" in features and "project" in features, features
    assert "Project quota inode:" in said
    assert "User quota inode:" not in said and "Group quota inode:" not in said
