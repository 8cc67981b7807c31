"""Which of a container's host binds are the pod's emptyDir volumes the guest keeps
(shim/host/emptydir.py), on directories shaped as kubelet makes them: a volume, a subPath
of one (a real bind, as kubelet makes it), one in memory, and what is neither."""
from __future__ import annotations

import os
import subprocess

import pytest

from shim.host import emptydir
from shim.host.emptydir import LocalDir
from testbed.kubeletdirs import binds, subpath_target, volume_dir  # noqa: F401 (a fixture)
from testbed.prereqs import require_root


def test_an_empty_dir_is_its_one_directory_with_kubelet_s_owner_and_mode(tmp_path) -> None:
    volume = volume_dir(tmp_path, "cache", 0o2777, 1234)
    assert emptydir.local_dirs(str(volume)) == (LocalDir("cache", 0o2777, 0, 1234),)
    assert emptydir.local_dirs(str(volume) + "/") == (LocalDir("cache", 0o2777, 0, 1234),)


def test_a_sub_path_is_found_by_the_directory_kubelet_bound(tmp_path,
        binds) -> None:  # noqa: F811
    require_root()
    volume = volume_dir(tmp_path, "cache")
    (volume / "a" / "b").mkdir(parents=True)
    os.chmod(volume / "a" / "b", 0o750)
    (volume / "a" / "c").mkdir()  # a sibling of the same mode: found by inode, not name
    target = binds(volume / "a" / "b",
                   subpath_target(tmp_path, "cache", "app"))
    assert emptydir.local_dirs(str(target)) == (
        LocalDir("cache", 0o777, 0, 0), LocalDir("cache/a", 0o755, 0, 0),
        LocalDir("cache/a/b", 0o750, 0, 0))


def test_a_sub_path_that_is_no_directory_of_the_volume_is_refused(tmp_path,
        binds) -> None:  # noqa: F811
    require_root()
    volume_dir(tmp_path, "cache")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    target = binds(elsewhere,
                   subpath_target(tmp_path, "cache", "app"))
    with pytest.raises(ValueError, match="not a directory kubelet made"):
        emptydir.local_dirs(str(target))


def test_memory_empty_dirs_and_other_volumes_stay_host_binds(tmp_path,
        binds) -> None:  # noqa: F811
    require_root()
    memory = volume_dir(tmp_path, "ram")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(memory)], check=True)
    try:
        assert emptydir.local_dirs(str(memory)) is None
    finally:
        subprocess.run(["umount", str(memory)], check=True)
    config = tmp_path / "pods" / "uid-1" / "volumes" / "kubernetes.io~configmap" / "cfg"
    config.mkdir(parents=True)
    assert emptydir.local_dirs(str(config)) is None
    # a subPath of a configMap: volume-subpaths has the same shape, no emptyDir of its name
    target = binds(config, subpath_target(tmp_path, "cfg", "app"))
    assert emptydir.local_dirs(str(target)) is None
    assert emptydir.local_dirs(str(tmp_path)) is None
    assert emptydir.local_dirs("/var/lib/kubelet/pods/u/volumes/kubernetes.io~empty-dir") is None
