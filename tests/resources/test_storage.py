"""The storage annotation podvm-webhook writes (issue 44) and the scratch disk it sizes."""
from __future__ import annotations

import json

import pytest

from shim.resources import PlanError
from shim.resources.storage import (ANNOTATION, BLANK_MIB, StorageRequest, encode,
                                    scratch_disk_mib, storage_request)

MIB = 1 << 20


def test_absent_annotation_is_none() -> None:
    assert storage_request({"other": "x"}) is None


def test_parses_sizes_and_unbounded() -> None:
    value = {"containers": {"app": 200 * MIB, "side": 0}, "emptyDirs": {"cache": MIB},
             "unbounded": ["container:log", "emptyDir:tmp", "container:log"]}
    req = storage_request({ANNOTATION: json.dumps(value)})
    assert req is not None
    assert dict(req.containers) == {"app": 200 * MIB, "side": 0}
    assert dict(req.empty_dirs) == {"cache": MIB}
    assert req.unbounded == ("container:log", "emptyDir:tmp")
    assert storage_request({ANNOTATION: encode(req)}) == req


@pytest.mark.parametrize("value, words", [
    ("{", "not JSON"),
    ("[]", "JSON object"),
    ('{"containers": {"a": -1}}', "negative"),
    ('{"containers": {"a": 1.5}}', "not an integer"),
    ('{"containers": {"a": "1Mi"}}', "not an integer"),
    ('{"containers": {"a": true}}', "not an integer"),
    ('{"emptyDirs": []}', "emptyDirs must be an object"),
    ('{"limits": {}}', "unknown keys"),
    ('{"unbounded": ["pod:a"]}', "unbounded entry"),
    ('{"unbounded": "container:a"}', "must be a list"),
    ('{"unbounded": [3]}', "unbounded entry"),
    ('{"containers": {"a": 1}, "unbounded": ["container:a"]}', "both"),
])
def test_malformed_values_name_the_annotation(value: str, words: str) -> None:
    with pytest.raises(PlanError, match=words) as err:
        storage_request({ANNOTATION: value})
    assert ANNOTATION in str(err.value)


def test_disk_is_the_pods_limits_plus_ext4() -> None:
    req = StorageRequest(containers={"a": 200 * MIB, "b": 100 * MIB},
                         empty_dirs={"e": 50 * MIB}, unbounded=())
    disk, why = scratch_disk_mib(req, 10240, BLANK_MIB)
    assert disk == 357 + 16 and "limits 350 MiB" in why  # ceil(350 * 1.02) + 16


def test_unbounded_adds_the_default_once() -> None:
    req = StorageRequest(containers={"a": 200 * MIB}, empty_dirs={},
                         unbounded=("container:b", "emptyDir:c"))
    disk, why = scratch_disk_mib(req, 1024, BLANK_MIB)
    assert disk == 204 + 16 + 1024 and "scratch_disk_mib 1024" in why


def test_no_annotation_is_the_default_and_small_ones_the_blank() -> None:
    assert scratch_disk_mib(None, 1000, BLANK_MIB)[0] == 1000  # the configured disk
    small = StorageRequest(containers={"a": MIB}, empty_dirs={}, unbounded=())
    disk, why = scratch_disk_mib(small, 10240, BLANK_MIB)
    assert disk == BLANK_MIB and "raised to" in why


def test_the_plan_has_the_disk_and_host_emptydirs_do_not_count() -> None:
    from shim.config import Config, HypervisorConfig, RuntimeConfig
    from shim.resources import ContainerResources, Host
    from shim.resources.planner import PodPlanner

    value = encode(StorageRequest(containers={"a": 200 * MIB}, empty_dirs={"e": 100 * MIB},
                                  unbounded=("emptyDir:f",)))
    for on_host, disk in ((False, 306 + 16 + 1024), (True, 204 + 16)):
        config = Config(qemu=HypervisorConfig(scratch_disk_mib=1024),
                        runtime=RuntimeConfig(disable_guest_empty_dir=on_host))
        plan = PodPlanner(config, {ANNOTATION: value}, ContainerResources(),
                          Host(cpus=4, memory_mib=8192)).plan()
        assert plan.disk_mib == disk and plan.explanation[-1].startswith(
            f"scratch disk {disk} MiB")
    no_disk = Config(qemu=HypervisorConfig(scratch_disk_mib=0))
    assert PodPlanner(no_disk, {ANNOTATION: value}, ContainerResources(),
                      Host(cpus=4, memory_mib=8192)).plan().disk_mib == 0
    with pytest.raises(PlanError, match=ANNOTATION):
        PodPlanner(Config(), {ANNOTATION: "{"}, ContainerResources(),
                   Host(cpus=4, memory_mib=8192)).plan()
