"""`podvm-node install` warns, in one line, where the configuration's scratch_path is not on
the mount of kubelet's pod log directory: the shim links each pod's scratch disk there
for kubelet to count (shim/host/podlogdisk.py), and a link cannot cross mounts. Real
mounts (a tmpfs, a bind mount of the same file system) in a scratch host root, made and
removed by the test."""
from __future__ import annotations

import errno
import os
import pathlib
import subprocess
from typing import Callable, Iterator

import pytest

from podvm_node import hostcheck, install
from testbed.prereqs import require_root, require_tool

V16 = "containerd github.com/containerd/containerd 1.6.20~ds1 1.6.20~ds1-1+deb12u3\n"
Mount = Callable[..., pathlib.Path]


@pytest.fixture
def mount(tmp_path: pathlib.Path) -> Iterator[Mount]:
    """mount(target, *args): `mount args... target`, the target made first; every mount
    is taken off at the end."""
    require_root()
    require_tool("mount", "mount")
    made: list[pathlib.Path] = []

    def do(target: pathlib.Path, *args: str) -> pathlib.Path:
        target.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", *args, str(target)], check=True)
        made.append(target)
        return target

    try:
        yield do
    finally:
        for target in reversed(made):
            subprocess.run(["umount", "-l", str(target)], check=True)


def host_root(tmp_path: pathlib.Path, qemu: str = "") -> pathlib.Path:
    """A host root whose podvm configuration's [hypervisor.qemu] is `qemu` (plus tcg)."""
    root = tmp_path / "host"
    for sub in ("etc/containerd", "etc/podvm", "usr/local/bin", "run", "var/log/pods",
                "var/lib"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    (root / "etc/containerd/config.toml").write_text("version = 2\n")
    (root / "etc/podvm/configuration.toml").write_text(
        f'[hypervisor.qemu]\naccel = "tcg"\n{qemu}')
    return root


def warning(root: pathlib.Path, bundled: str = "/nonexistent") -> str | None:
    """The line it says (it says at most one), or None."""
    lines: list[str] = []
    hostcheck.warn_scratch_mount(str(root), bundled, lines.append)
    assert len(lines) <= 1, lines
    return lines[0] if lines else None


def test_one_mount_says_nothing(tmp_path) -> None:
    root = host_root(tmp_path)
    assert warning(root) is None  # neither /var/log/pods's nor scratch_path's ancestors
    (root / "var/lib/podvm/scratch").mkdir(parents=True)
    assert warning(root) is None


def test_another_file_system_is_said_in_one_line(tmp_path, mount) -> None:
    root = host_root(tmp_path)
    mount(root / "var/lib/podvm", "-t", "tmpfs", "tmpfs")
    # scratch_path itself not made yet: the mount the shim would make it on
    line = warning(root)
    assert line is not None and "\n" not in line, line
    assert line.startswith("warning: scratch_path /var/lib/podvm/scratch is not on the "
                           "mount of kubelet's pod log directory /var/log/pods"), line
    assert "kubelet sees no disk use" in line


def test_a_bind_mount_of_the_same_file_system_is_another_mount(tmp_path, mount) -> None:
    """The same device, but link(2) refuses it (EXDEV) all the same: the check is the
    mount's, not the device's."""
    root = host_root(tmp_path)
    (tmp_path / "disk").mkdir()
    scratch = mount(root / "var/lib/podvm/scratch", "--bind", str(tmp_path / "disk"))
    assert scratch.stat().st_dev == (root / "var/log/pods").stat().st_dev
    (scratch / "disk").write_text("")
    with pytest.raises(OSError) as refused:
        os.link(scratch / "disk", root / "var/log/pods/disk")
    assert refused.value.errno == errno.EXDEV
    assert warning(root) is not None


def test_kubelets_directory_on_its_own_mount_and_the_configured_path(tmp_path, mount) -> None:
    """The host's configuration's scratch_path is the one looked at (the bundle's only
    where the host has none), and moving it onto /var/log/pods's mount ends the warning."""
    root = host_root(tmp_path)
    mount(root / "var/log", "-t", "tmpfs", "tmpfs")
    (root / "var/log/pods").mkdir()
    assert "scratch_path /var/lib/podvm/scratch " in warning(root)
    root = host_root(tmp_path, 'scratch_path = "/var/log/podvm-scratch"\n')
    assert warning(root) is None
    bundled = tmp_path / "bundled.toml"
    bundled.write_text('[hypervisor.qemu]\nscratch_path = "/var/lib/elsewhere"\n')
    assert warning(root, str(bundled)) is None  # the host's configuration wins
    (root / "etc/podvm/configuration.toml").unlink()
    assert "scratch_path /var/lib/elsewhere " in warning(root, str(bundled))


def test_host_links_resolve_in_the_host_root(tmp_path, mount) -> None:
    """An absolute symlink on the host (/var/log/pods -> /srv/pods) is the host's /srv,
    never the installer's own."""
    root = host_root(tmp_path)
    (root / "var/log/pods").rmdir()
    mount(root / "srv", "-t", "tmpfs", "tmpfs")
    (root / "srv/pods").mkdir()
    (root / "var/log/pods").symlink_to("/srv/pods")
    assert warning(root) is not None
    (root / "srv/podvm").mkdir()
    (root / "var/lib/podvm").symlink_to("/srv/podvm")  # the scratch disks there too
    assert warning(root) is None


def test_no_scratch_disk_no_warning(tmp_path, mount) -> None:
    root = host_root(tmp_path, "scratch_disk_mib = 0\n")
    mount(root / "var/lib/podvm", "-t", "tmpfs", "tmpfs")
    assert warning(root) is None


def test_install_says_it_and_installs(tmp_path, mount) -> None:
    """A warning, not a refusal: the install goes on and the warning is among its lines."""
    root = host_root(tmp_path)
    mount(root / "var/lib/podvm", "-t", "tmpfs", "tmpfs")
    bundle = tmp_path / "bundle"
    (bundle / "etc").mkdir(parents=True)
    (bundle / "manifest.json").write_text("{}\n")
    (bundle / "etc/configuration.toml").write_text('[hypervisor.qemu]\naccel = "tcg"\n')
    lines: list[str] = []
    restarts: list[str] = []
    install.install(str(root), str(bundle), restart=lambda: restarts.append("restart"),
                    version_text=V16, say=lines.append)
    assert restarts == ["restart"]
    assert [line for line in lines if line.startswith("warning: scratch_path")], lines
    assert (root / "opt/podvm/current/manifest.json").is_file()
    install.uninstall(str(root), restart=lambda: None, say=lambda line: None)
