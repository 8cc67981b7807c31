"""The pod's file server (shim/vm/virtiofsd.py) beside a real QEMU under TCG: the guest's
RAM is shared with it, its threads are the VM's (role `files`), it goes with the VM, and
every way it fails to come up is said. And the command lines: the virtio-fs device on a
booted VM, none on one to be saved (QEMU 7.2 cannot save it), its root port on both;
9p only where the configuration names it."""
from __future__ import annotations

import asyncio
import dataclasses
import os
import pathlib

import psutil
import pytest

from shim.host.cleanup import processes_of
from shim.vm import virtiofsd
from shim.vm.agent import Agent
from shim.vm.hypervisor import HypervisorError, MissingFile, ThreadRole
from shim.vm.qemu import command as qemu_command
from shim.vm.qemu.driver import QemuVM
from testbed.shimproc import alive
from testbed.vmconfig import VIRTIOFS_DAEMONS, virtiofs_daemon
from tests.vm.test_qemu import spec


def _servers(marker: str) -> list[int]:
    return processes_of("virtiofsd", marker)


@pytest.mark.parametrize("daemon", VIRTIOFS_DAEMONS)
async def test_the_guest_s_ram_is_shared_and_virtiofsd_serves_beside_qemu(tmp_path,
                                                                          daemon) -> None:
    """Either daemon, each spoken to in its own words: the Rust one (Debian 13's, as
    `make test` fetches it: podvm_node/rust_virtiofsd.py) and QEMU 7.2's (Debian 12's
    qemu-system-common)."""
    binary = virtiofs_daemon(daemon)
    vm = QemuVM(spec(tmp_path, virtio_fs_daemon=binary))
    await vm.launch()
    try:
        agent = Agent.of_vm(vm)
        await agent.ping(timeout=30)
        await agent.close()
        maps = pathlib.Path(f"/proc/{vm.pid}/maps").read_text().splitlines()
        ram = [m.split()[1] for m in maps if "memfd:" in m and m.split()[-2] != "0"]
        assert ram and set(ram) == {"rw-s"}, ram  # shared: virtiofsd maps it too
        roles = await vm.threads()
        assert roles[ThreadRole.FILES] and vm.helper_pids
        for pid in vm.helper_pids:
            assert {t.id for t in psutil.Process(pid).threads()} <= set(roles[ThreadRole.FILES])
        sock = virtiofsd.virtio_fs_socket(vm.spec.workdir)
        assert _servers(sock) == sorted(vm.helper_pids)
        words = psutil.Process(vm.helper_pids[0]).cmdline()
        assert words[0] == binary
        assert (f"--shared-dir={vm.spec.shared_dir}" in words) == (daemon == "rust")
        assert (f"source={vm.spec.shared_dir}" in words) == (daemon == "qemu-7.2")
    finally:
        await vm.stop()
    assert _servers(sock) == []  # gone with the VM


async def test_a_missing_virtiofsd_is_named_before_anything_starts(tmp_path) -> None:
    vm = QemuVM(spec(tmp_path, virtio_fs_daemon="/nonexistent/virtiofsd"))
    with pytest.raises(MissingFile, match="virtio_fs_daemon /nonexistent/virtiofsd does not "
                                          "exist: run `make install` or `podvm-node "
                                          "install` \\(podvm's own Rust virtiofsd\\)"):
        await vm.launch()
    assert not os.path.exists(vm.spec.workdir)


async def test_a_virtiofsd_that_exits_at_start_is_quoted_and_qemu_never_runs(tmp_path) -> None:
    fake = tmp_path / "virtiofsd"
    fake.write_text("#!/bin/sh\necho 'fuse: cannot set up the sandbox' >&2\nexit 3\n")
    fake.chmod(0o755)
    vm = QemuVM(spec(tmp_path, virtio_fs_daemon=str(fake)))
    with pytest.raises(HypervisorError, match="virtiofsd of sandbox hv-test exited with "
                                              "status 3: fuse: cannot set up the sandbox"):
        await vm.launch()
    assert vm._proc is None


async def test_a_virtiofsd_that_never_listens_is_stopped_and_said(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(virtiofsd, "START_TIMEOUT", 0.5)
    fake = tmp_path / "virtiofsd"
    fake.write_text("#!/bin/sh\nexec sleep 60\n")
    fake.chmod(0o755)
    vm = QemuVM(spec(tmp_path, virtio_fs_daemon=str(fake)))
    with pytest.raises(HypervisorError, match="did not listen on .*virtiofs.sock within"):
        await vm.launch()
    assert vm._proc is None and _servers(str(tmp_path)) == []


async def test_a_start_under_way_is_given_up_by_stop_and_its_error_kept_for_ready(
        tmp_path, monkeypatch) -> None:
    """A restore starts virtiofsd while QEMU loads the state (start_soon) and waits for
    it only before adding the device (ready): a stop meanwhile leaves no daemon and no
    task behind, and a start that failed says so at ready, in its own words."""
    monkeypatch.setattr(virtiofsd, "START_TIMEOUT", 5)
    hangs = tmp_path / "hangs"
    hangs.write_text("#!/bin/sh\n[ \"$1\" = --print-capabilities ] && exit 0\nexec sleep 60\n")
    hangs.chmod(0o755)
    server = virtiofsd.FileServer(spec(tmp_path, virtio_fs_daemon=str(hangs)))
    os.makedirs(server.spec.workdir)  # QemuVM.launch makes it
    server.start_soon(None)
    for _ in range(200):  # until its process runs
        if server.pid:
            break
        await asyncio.sleep(0.01)
    pid = server.pid
    assert pid and psutil.pid_exists(pid)
    await server.stop(timeout=0.5)
    assert not alive(pid)  # gone, or a zombie its parent has yet to reap
    assert server._starting is None
    fails = tmp_path / "fails"
    fails.write_text("#!/bin/sh\necho 'cannot open the shared directory' >&2\nexit 4\n")
    fails.chmod(0o755)
    server = virtiofsd.FileServer(spec(tmp_path, virtio_fs_daemon=str(fails)))
    server.start_soon(None)
    with pytest.raises(HypervisorError, match="exited with status 4: cannot open the shared"):
        await server.ready()
    await server.stop()


def test_the_device_is_on_a_booted_vm_and_not_on_one_to_be_saved(tmp_path) -> None:
    booted = spec(tmp_path)
    line = " ".join(qemu_command.command(booted))
    port = f"pcie-root-port,id={qemu_command.FS_PORT}"
    assert port in line and "vhost-user-fs-pci" in line and "virtio-9p" not in line
    assert f"memory-backend-memfd,id={qemu_command.RAM},size=256M,share=on" in line
    assert "podvm_share=virtiofs" in line
    for template in (dataclasses.replace(booted, template=True, saved=True),
                     dataclasses.replace(booted, template=True)):  # saved, restored
        line = " ".join(qemu_command.command(template))
        assert port in line and "vhost-user-fs-pci" not in line
    restored = dataclasses.replace(booted, template=True, memory_path="/proc/self/fd/9")
    assert "memory-backend-file,mem-path=/proc/self/fd/9,id=ram,size=256M,share=on" in \
        " ".join(qemu_command.command(restored))
    device = qemu_command.virtio_fs_device()
    assert device["bus"] == qemu_command.FS_PORT and device["tag"] == qemu_command.SHARE_TAG


def test_9p_only_where_the_configuration_names_it(tmp_path) -> None:
    nine_p = spec(tmp_path, shared_fs="virtio-9p")
    line = " ".join(qemu_command.command(nine_p))
    assert "virtio-9p-pci" in line and "vhost-user-fs" not in line and "pcie-root-port" \
        not in line and "podvm_share=9p" in line
    assert virtiofsd.command(spec(tmp_path), False)[1:3] == [
        f"--socket-path={tmp_path}/vm/virtiofs.sock", "-o"]


def _daemon(tmp_path, script: str) -> str:
    fake = tmp_path / "fake-virtiofsd"
    fake.write_text("#!/bin/sh\n" + script + "\n")
    fake.chmod(0o755)
    return str(fake)


async def test_each_daemon_gets_the_words_its_capabilities_announce(tmp_path, monkeypatch) \
        -> None:
    """"separate-options" (vhost-user.json): one flag an option; anything else, the C
    daemon's `-o` words; a daemon that never answers is given up on and not left."""
    rust = _daemon(tmp_path, """echo '{"type": "fs", "features": ["separate-options"]}'""")
    assert await virtiofsd.separate_options(rust)
    line = virtiofsd.command(spec(tmp_path, virtio_fs_daemon=rust, virtio_fs_cache="none"),
                             True)
    assert line[0] == rust and "-o" not in line and "--cache=never" in line
    assert {"--sandbox=namespace", "--seccomp=kill", "--modcaps=-mknod:-setfcap", "--xattr",
            f"--xattrmap={virtiofsd.XATTR_MAP}", "--announce-submounts"} <= set(line)
    old = _daemon(tmp_path, """echo '{"type": "fs"}'""")
    assert not await virtiofsd.separate_options(old)
    c_line = virtiofsd.command(spec(tmp_path, virtio_fs_cache="none"), False)
    assert {"cache=none", "posix_lock", "flock", "sandbox=namespace"} <= set(c_line)
    for script in ("echo not json", "exit 1", "echo '[1]'"):
        assert not await virtiofsd.separate_options(_daemon(tmp_path, script))
    assert not await virtiofsd.separate_options(str(tmp_path / "absent"))
    monkeypatch.setattr(virtiofsd, "START_TIMEOUT", 0.3)
    hung = _daemon(tmp_path, "echo $$ > " + str(tmp_path / "pid") + "; exec sleep 60")
    assert not await virtiofsd.separate_options(hung)
    pid = int((tmp_path / "pid").read_text())
    assert not alive(pid)  # gone, or a zombie its parent has yet to reap
