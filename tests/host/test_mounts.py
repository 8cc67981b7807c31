"""Real mounts: rootfs, unmount_all, refusing rmtree, what is mounted below a path."""
from __future__ import annotations

import pathlib

import pytest

from shim.host import mounts
from shim.host.cleanup import remove_tree
from testbed.prereqs import require_root


@pytest.fixture
def area(tmp_path: pathlib.Path):
    require_root()
    yield tmp_path
    mounts.unmount_all(str(tmp_path))


def test_mount_unmount_all_and_refusing_rmtree(area: pathlib.Path) -> None:
    """A shim that crashed left a mount on a container's path; the next pod of the same
    name mounts over it: unmounting once would uncover the old one, not remove it."""
    target = area / "shared" / "c1" / "rootfs"
    target.mkdir(parents=True)
    for name in ("old", "new"):
        mounts.mount(mounts.Mount("tmpfs", "tmpfs", ("size=1m", "nosuid")), str(target))
        (target / name).write_text(name)
    assert sorted(p.name for p in target.iterdir()) == ["new"]
    with pytest.raises(OSError, match="still mounted"):
        remove_tree(str(area / "shared"))
    assert mounts.unmount_all(str(area / "shared")) == 2
    assert mounts.mounts_under(str(area / "shared")) == []
    remove_tree(str(area / "shared"))
    assert not (area / "shared").exists()


def test_unmount_does_not_follow_a_symlink(area: pathlib.Path) -> None:
    """A guest's symlink where a mount point was leads nowhere: the mount it points to
    stays."""
    victim = area / "victim"
    victim.mkdir()
    mounts.mount(mounts.Mount("tmpfs", "tmpfs", ("size=1m",)), str(victim))
    (area / "link").symlink_to(victim)
    assert not mounts.unmount(str(area / "link"))
    assert mounts.mounts_under(str(victim)) == [str(victim)]
    assert mounts.unmount(str(victim))


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
