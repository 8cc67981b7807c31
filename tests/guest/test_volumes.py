"""The agent's side of the pod's own volumes (guest/agent/volumes.py), in a directory of
the host standing for the scratch disk's: directories made with the owner and mode
asked, those there left as the containers left them, and a link a container put where
a subPath goes refused, not followed. Seen in a pod in tests/e2e/test_file_semantics.py."""
from __future__ import annotations

import os
import pathlib

import pytest

from guest.agent import volumes, writable
from podvm_core.ttrpc import Code, TtrpcError
from tests.guest.conftest import Dir


def mode(path: pathlib.Path) -> tuple[int, int, int]:
    st = path.stat()
    return st.st_mode & 0o7777, st.st_uid, st.st_gid


def test_each_directory_is_made_with_its_owner_and_mode(volumes_root) -> None:
    volumes.make([Dir("cache", 0o2777, 0, 1234), Dir("cache/a", 0o755, 1000, 1000),
                  Dir("cache/a/b", 0o750, 0, 1234)])
    assert mode(volumes_root / "cache") == (0o2777, 0, 1234)
    assert mode(volumes_root / "cache" / "a") == (0o755, 1000, 1000)
    assert mode(volumes_root / "cache" / "a" / "b") == (0o750, 0, 1234)


def test_what_is_there_is_left_as_the_containers_left_it(volumes_root) -> None:
    volumes.make([Dir("cache", 0o777)])
    (volumes_root / "cache" / "kept").write_text("data")
    os.chmod(volumes_root / "cache", 0o700)
    volumes.make([Dir("cache", 0o777), Dir("cache/sub", 0o755)])
    assert mode(volumes_root / "cache")[0] == 0o700
    assert (volumes_root / "cache" / "kept").read_text() == "data"
    assert (volumes_root / "cache" / "sub").is_dir()


@pytest.mark.parametrize("link_at", ["cache/sub", "cache"])
def test_a_link_where_a_directory_goes_is_refused_and_not_followed(volumes_root, tmp_path,
                                                                   link_at) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    volumes_root.mkdir()
    if link_at == "cache":
        (volumes_root / "cache").symlink_to(outside)
    else:
        (volumes_root / "cache").mkdir()
        (volumes_root / "cache" / "sub").symlink_to(outside)
    with pytest.raises(TtrpcError) as err:
        volumes.make([Dir("cache"), Dir("cache/sub"), Dir("cache/sub/deeper")])
    assert err.value.code == Code.FAILED_PRECONDITION
    assert "is a link or no directory" in err.value.message, err.value.message
    assert list(outside.iterdir()) == []


def test_a_file_where_a_directory_goes_is_refused(volumes_root) -> None:
    volumes_root.mkdir()
    (volumes_root / "cache").write_text("")
    with pytest.raises(TtrpcError, match="cache is a link or no directory"):
        volumes.make([Dir("cache")])


@pytest.mark.parametrize("bad", ["", "/abs", "a/../b", "a//b", ".", "a/.", "a\0b"])
def test_a_path_that_is_not_plain_names_is_refused(volumes_root, bad) -> None:
    with pytest.raises(TtrpcError) as err:
        volumes.make([Dir(bad)])
    assert err.value.code == Code.INVALID_ARGUMENT


def test_no_volume_mounts_nothing(monkeypatch) -> None:
    monkeypatch.setattr(writable, "mount_scratch", lambda: pytest.fail("mounted the disk"))
    volumes.make([])
