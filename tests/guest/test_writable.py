"""The agent's side of a container's writable layer (guest/agent/writable.py) that needs
no guest: the scratch disk found by its serial alone, and container ids that could name
anything but one directory of the disk refused. The layer itself is seen in a pod
(tests/e2e/test_file_semantics.py, tests/e2e/test_hostile_guest.py)."""
from __future__ import annotations

import pathlib

import pytest

from guest.agent import writable
from podvm_core.ttrpc import Code, TtrpcError


def sys_block(tmp_path: pathlib.Path, serials: dict[str, str | None]) -> str:
    for name, serial in serials.items():
        (tmp_path / name).mkdir()
        if serial is not None:
            (tmp_path / name / "serial").write_text(serial + "\n")
    return str(tmp_path)


def test_the_disk_is_the_one_with_podvm_s_serial(tmp_path) -> None:
    found = writable.scratch_device(sys_block(tmp_path, {
        "pmem0": None, "vda": "other-disk", "vdb": writable.SERIAL}))
    assert found == "/dev/vdb"


def test_no_such_disk_is_said(tmp_path) -> None:
    with pytest.raises(TtrpcError) as err:
        writable.scratch_device(sys_block(tmp_path, {"vda": "other-disk"}))
    assert err.value.code == Code.FAILED_PRECONDITION and writable.SERIAL in err.value.message


@pytest.mark.parametrize("bad", ["", ".", "..", "a/b", "../etc", "-x", "a,upperdir=/",
                                 "a:b", "x" * 200, "a\nb"])
def test_an_id_that_is_not_one_plain_name_is_refused(bad) -> None:
    with pytest.raises(TtrpcError) as err:
        writable.layer_dir(bad)
    assert err.value.code == Code.INVALID_ARGUMENT


def test_a_containerd_id_is_a_directory_of_the_disk() -> None:
    cid = "4f1c0a9e" * 8
    assert writable.layer_dir(cid) == f"{writable.SCRATCH}/layers/{cid}"
    assert writable.layer_dir("my-app_1.2") == f"{writable.SCRATCH}/layers/my-app_1.2"
