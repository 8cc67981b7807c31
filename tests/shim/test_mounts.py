"""Real mounts: rootfs, binds of files and directories, unmount_all, refusing rmtree."""
from __future__ import annotations

import pathlib

import pytest

from shim import mounts
from shim.cleanup import remove_tree
from tests.conftest import require_root


@pytest.fixture
def area(tmp_path: pathlib.Path):
    require_root()
    yield tmp_path
    mounts.unmount_all(str(tmp_path))


def test_mount_bind_and_unmount_all(area: pathlib.Path) -> None:
    root = area / "rootfs"
    root.mkdir()
    mounts.mount(mounts.Mount("tmpfs", "tmpfs", ("size=1m", "nosuid")), str(root))
    (root / "hello").write_text("hi")
    shared = area / "shared" / "c1" / "rootfs"
    mounts.bind(str(root), str(shared))
    assert (shared / "hello").read_text() == "hi"
    host_file = area / "hosts"
    host_file.write_text("127.0.0.1 localhost\n")
    ro_target = area / "shared" / "c1" / "mounts" / "2-hosts"
    mounts.bind(str(host_file), str(ro_target), readonly=True)
    assert ro_target.read_text().startswith("127.0.0.1")
    with pytest.raises(OSError):
        ro_target.write_text("changed")
    with pytest.raises(OSError, match="still mounted"):
        remove_tree(str(area / "shared"))
    assert host_file.exists() and (root / "hello").exists()  # nothing was removed
    assert mounts.unmount_all(str(area / "shared")) == 2
    remove_tree(str(area / "shared"))
    assert not (area / "shared").exists() and host_file.exists()
    assert mounts.unmount(str(root)) and not mounts.unmount(str(root))


def test_unmount_all_takes_stacked_mounts_too(area: pathlib.Path) -> None:
    """A shim that crashed left a bind on a container's path; the next pod of the same
    name binds over it: unmounting once would uncover the old one, not remove it."""
    target = area / "shared" / "c1" / "rootfs"
    for name in ("old", "new"):
        source = area / name
        source.mkdir()
        (source / name).write_text(name)
        mounts.bind(str(source), str(target))
    assert (target / "new").exists()
    assert mounts.unmount_all(str(area / "shared")) == 2
    assert mounts.mounts_under(str(area / "shared")) == []
    remove_tree(str(area / "shared"))


def test_bad_mount_names_what_failed(area: pathlib.Path) -> None:
    with pytest.raises(OSError, match="nosuchfs"):
        mounts.mount(mounts.Mount("nosuchfs", "x", ()), str(area))
    assert mounts.split_options(["ro", "rbind", "lowerdir=/a:/b", "rw"]) == (
        mounts.MS_RDONLY | mounts.MS_BIND | mounts.MS_REC, "lowerdir=/a:/b")
