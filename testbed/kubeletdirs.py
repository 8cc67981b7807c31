"""Volume directories shaped as kubelet makes them, for the tests of the pod's own
emptyDir volumes (shim/host/emptydir.py): kubelet's root on a disk (an emptyDir on a
tmpfs is one of medium Memory), a volume, and a subPath's bind, undone afterwards."""
from __future__ import annotations

import os
import pathlib
import subprocess
import tempfile
from collections.abc import Callable, Iterator

import pytest

from shim.host.emptydir import PLUGIN

POD_UID = "uid-1"


def volume_dir(root: pathlib.Path, name: str, mode: int = 0o777,
               gid: int = 0) -> pathlib.Path:
    """An emptyDir `name` as kubelet makes it (0777; fsGroup's group, set-group-ID)."""
    volume = root / "pods" / POD_UID / "volumes" / PLUGIN / name
    volume.mkdir(parents=True)
    os.chown(volume, 0, gid)
    os.chmod(volume, mode)
    return volume


def subpath_target(root: pathlib.Path, volume: str, container: str, index: int = 0
                   ) -> pathlib.Path:
    return root / "pods" / POD_UID / "volume-subpaths" / volume / container / str(index)


@pytest.fixture
def kubelet_root() -> Iterator[pathlib.Path]:
    with tempfile.TemporaryDirectory(dir="/var/tmp", prefix="podvm-kubelet-") as root:
        yield pathlib.Path(root)


@pytest.fixture
def binds() -> Iterator[Callable[[pathlib.Path, pathlib.Path], pathlib.Path]]:
    """bind(source, target): a bind mount, as kubelet makes a subPath's; undone after
    the test."""
    made: list[pathlib.Path] = []

    def bind(source: pathlib.Path, target: pathlib.Path) -> pathlib.Path:
        target.mkdir(parents=True)
        subprocess.run(["mount", "--bind", str(source), str(target)], check=True)
        made.append(target)
        return target

    yield bind
    for target in reversed(made):
        subprocess.run(["umount", str(target)], check=True)
