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


def test_submounts_are_listed_shallowest_first_with_their_own_flags(area: pathlib.Path) -> None:
    volume = area / "vol ume"  # a space: escaped in mountinfo
    (volume / "cache").mkdir(parents=True)
    (volume / "plain").mkdir()
    assert mounts.submounts(str(volume)) == []
    mounts.mount(mounts.Mount("tmpfs", "tmpfs", ("size=1m", "nosuid", "nodev")),
                 str(volume / "cache"))
    (volume / "cache" / "frozen").mkdir()
    mounts.mount(mounts.Mount("tmpfs", "tmpfs", ("size=1m", "ro", "noexec")),
                 str(volume / "cache" / "frozen"))
    assert mounts.submounts(str(volume)) == [
        mounts.Submount("cache", ("rw", "nosuid", "nodev")),
        mounts.Submount("cache/frozen", ("ro", "noexec"))]
    assert mounts.submounts(str(volume / "plain")) == []
    assert mounts.submounts(str(area / "missing")) == []
    assert mounts.mounts_under(str(volume)) == [str(volume / "cache" / "frozen"),
                                                str(volume / "cache")]


def test_a_read_only_bind_leaves_its_submounts_writable(area: pathlib.Path) -> None:
    """As runc's `ro`: the remount that makes a bind read-only is not recursive."""
    volume = area / "volume"
    (volume / "cache").mkdir(parents=True)
    mounts.mount(mounts.Mount("tmpfs", "tmpfs", ("size=1m",)), str(volume / "cache"))
    shared = area / "shared" / "c1" / "mounts" / "0-volume"
    mounts.bind(str(volume), str(shared), readonly=True)
    with pytest.raises(OSError):
        (shared / "top").write_text("no")
    (shared / "cache" / "written").write_text("yes")
    assert (volume / "cache" / "written").read_text() == "yes"
    assert mounts.submounts(str(shared)) == [mounts.Submount("cache", ("rw",))]
