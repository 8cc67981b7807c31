"""`make install` as a user runs it: idempotent, binaries on PATH, configuration kept."""
from __future__ import annotations

import pathlib
import subprocess

from testbed.prereqs import require_root

ROOT = pathlib.Path(__file__).resolve().parents[1]


def make_install(tmp: pathlib.Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["make", "-C", str(ROOT), "install", f"PREFIX={tmp}/opt", f"BINDIR={tmp}/bin",
         f"CONFDIR={tmp}/etc", f"GUESTDIR={tmp}/guest"], capture_output=True, text=True,
        timeout=600)


def test_install_twice_and_run(tmp_path: pathlib.Path) -> None:
    require_root()
    (tmp_path / "bin").mkdir()
    first = make_install(tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    shim = tmp_path / "bin" / "containerd-shim-podvm-v2"
    version = subprocess.run([str(shim), "-v"], capture_output=True, text=True)
    assert version.returncode == 0 and "Version:" in version.stdout
    for name in ("vmlinux", "initrd.img", "rootfs.img"):
        assert (tmp_path / "guest" / name).stat().st_size > 1 << 20
    # the root image's padding stays a hole
    image = (tmp_path / "guest" / "rootfs.img").stat()
    assert image.st_blocks * 512 < image.st_size
    conf = tmp_path / "etc" / "configuration.toml"
    assert conf.read_text() == (ROOT / "packaging" / "configuration.toml").read_text()
    conf.write_text("[hypervisor.qemu]\naccel = \"tcg\"\n")  # the admin's own edit
    second = make_install(tmp_path)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "keeping existing" in second.stdout
    assert conf.read_text() == "[hypervisor.qemu]\naccel = \"tcg\"\n"
    ctl = subprocess.run([str(tmp_path / "bin" / "podvmctl"), "config", "--file", str(conf)],
                         capture_output=True, text=True)
    assert ctl.returncode == 0 and 'accel = "tcg"' in ctl.stdout
    webhook = subprocess.run([str(tmp_path / "bin" / "podvm-webhook"), "--help"],
                             capture_output=True, text=True)
    assert webhook.returncode == 0 and "--cert" in webhook.stdout, webhook.stderr
    # The installed copy stands alone: generated protos inside, not the source tree's.
    imported = subprocess.run([str(tmp_path / "opt" / "venv" / "bin" / "python"), "-c",
                               "import podvm_core.pb.ttrpc_pb2 as m; print(m.__file__)"],
                              capture_output=True, text=True, cwd="/")
    assert imported.returncode == 0 and str(tmp_path / "opt") in imported.stdout
