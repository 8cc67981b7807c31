"""The QEMU driver on a real QEMU (TCG) with the real guest image."""
from __future__ import annotations

import asyncio
import os
import pathlib
import re
import signal

import pytest

from shim.vm.agent import Agent
from shim.vm.hypervisor import (BootTimeout, HypervisorError, MissingFile, ThreadRole,
                                VMExited, VMSpec)
from shim.vm.qemu.driver import QemuVM
from testbed.prereqs import require_root
from testbed.vmconfig import vm_config


def spec(tmp_path: pathlib.Path, **qemu: object) -> VMSpec:
    require_root()
    cfg = vm_config(**qemu)
    (tmp_path / "shared").mkdir(exist_ok=True)
    return VMSpec(sandbox_id="hv-test", workdir=str(tmp_path / "vm"),
                  shared_dir=str(tmp_path / "shared"), vcpus=2, max_vcpus=4, memory_mib=256,
                  max_memory_mib=1024, hypervisor=cfg.qemu, config_source="/etc/x.toml")


async def test_boot_threads_and_stop(tmp_path) -> None:
    vm = QemuVM(spec(tmp_path))
    await vm.launch()
    try:
        agent = Agent.of_vm(vm)
        info = await agent.ping(timeout=30)
        assert info.online_cpus == 2 and info.kernel_release
        roles = await vm.threads()
        # Under TCG every vCPU the VM may have is plugged at boot, the guest onlines 2
        assert len(roles[ThreadRole.VCPU]) == 4 and await vm.size() == (4, 256)
        # No transparent huge pages: a page the guest touched costs 4 KiB, not 2 MiB
        assert "THP_enabled:\t0" in open(f"/proc/{vm.pid}/status").read()
        assert roles[ThreadRole.MAIN] == [vm.pid]
        tasks = {int(t) for t in os.listdir(f"/proc/{vm.pid}/task")}
        placed = {t for tids in roles.values() for t in tids}
        assert tasks <= placed  # every thread has a role
        assert set(roles[ThreadRole.VCPU]) <= tasks
        await agent.close()
    finally:
        await vm.stop()
    assert not os.path.exists(f"/proc/{vm.pid}") or "Z" in open(f"/proc/{vm.pid}/stat").read()
    assert not os.path.exists(vm.agent_socket) and not os.path.exists(vm.qmp_socket)


async def test_kvm_that_cannot_run_a_guest_is_podvm_error_naming_the_setting(tmp_path) -> None:
    """Nested KVM fails differently from machine to machine: the guest hangs, QEMU aborts
    at once (`failed to set MSR`), or /dev/kvm is missing. Whichever happens here, the
    answer is podvm's own error, in QEMU's words when it said any, naming the setting
    and the file to change, and QEMU is gone."""
    # 1 s: no guest reaches its agent that fast, and under nested KVM it never does.
    vm = QemuVM(spec(tmp_path, accel="kvm", boot_timeout=1))
    with pytest.raises(HypervisorError) as err:
        await vm.launch()
    message = str(err.value)
    assert 'accel = "kvm" in /etc/x.toml' in message and 'set accel = "tcg"' in message
    if isinstance(err.value, BootTimeout):  # the guest hung
        assert "did not come up within 1s (accel=kvm): " in message
        assert any(stage in message for stage in (  # how far it got is said
            "QMP socket", "QMP handshake", "agent socket", "QMP cont",
            "never opened its agent port"))
    else:  # QEMU ended by itself: its own last words are quoted
        assert isinstance(err.value, VMExited), repr(err.value)
        said = (tmp_path / "vm" / "qemu.log").read_text().strip().splitlines()
        assert said and said[-1].strip() in message
        assert "before the guest came up" in message
    assert vm._proc is not None and vm._proc.returncode is not None  # gone


async def test_guest_that_does_not_come_up_in_time_says_where_it_was(tmp_path) -> None:
    """A TCG guest needs more than 2 s to reach its agent: the timeout says the guest ran
    and never opened its port, and where each vCPU in 64-bit mode was (a kernel hang
    under `quiet` leaves nothing else), and QEMU is gone."""
    vm = QemuVM(spec(tmp_path, boot_timeout=2))
    with pytest.raises(BootTimeout) as err:
        await vm.launch()
    message = str(err.value)
    assert "did not come up within 2s (accel=tcg): the guest ran but never opened its " \
           "agent port" in message, message
    pointers = message.split("vCPU instruction pointers: ", 1)[1].split(", ")
    # the boot CPU at least (a vCPU not yet in 64-bit mode has an EIP, not an RIP)
    assert 1 <= len(pointers) <= 4, message
    assert all(re.fullmatch(r"0x[0-9a-f]+", p) for p in pointers), message
    assert vm._proc is not None and vm._proc.returncode is not None


async def test_qemu_that_aborts_at_start_is_quoted(tmp_path) -> None:
    """A kernel QEMU cannot load makes it exit at once: the error quotes QEMU."""
    junk = tmp_path / "junk-vmlinux"
    junk.write_bytes(bytes(range(256)) * 16)
    vm = QemuVM(spec(tmp_path, kernel=str(junk)))
    with pytest.raises(VMExited) as err:
        await vm.launch()
    said = (tmp_path / "vm" / "qemu.log").read_text().strip().splitlines()
    assert said, "QEMU wrote nothing to its log"
    message = str(err.value)
    assert "exited with status 1 before the guest came up" in message
    assert f"QEMU said: {said[-1].strip()}" in message or said[-1].strip() in message
    assert 'accel = "tcg" in /etc/x.toml' in message
    assert vm._proc is not None and vm._proc.returncode == 1
    assert not os.path.exists(vm.qmp_socket) and not os.path.exists(vm.agent_socket)


async def test_qemu_killed_while_booting_or_running_is_named(tmp_path) -> None:
    vm = QemuVM(spec(tmp_path))
    booting = asyncio.create_task(vm.launch())
    while vm._proc is None:
        await asyncio.sleep(0.01)
    os.kill(vm.pid, signal.SIGKILL)
    with pytest.raises(VMExited, match="was killed by signal SIGKILL before the guest came up"):
        await booting

    vm = QemuVM(spec(tmp_path))
    await vm.launch()
    try:
        os.kill(vm.pid, signal.SIGKILL)
        with pytest.raises(VMExited, match="killed by signal SIGKILL while the pod was running"):
            await vm.threads()
        with pytest.raises(VMExited, match="SIGKILL while the pod was running"):
            await vm.size()
    finally:
        await vm.stop()


async def test_missing_kernel_is_named(tmp_path) -> None:
    vm = QemuVM(spec(tmp_path, kernel="/nonexistent/vmlinux"))
    with pytest.raises(MissingFile, match="kernel /nonexistent/vmlinux does not exist.*"
                                          "/etc/x.toml"):
        await vm.launch()


async def test_root_image_not_in_whole_memory_blocks_is_refused_before_launch(tmp_path) -> None:
    """virtio-pmem puts the image where a hot-plugged DIMM would follow it: an image that
    does not end on a guest memory block would leave that DIMM unusable."""
    odd = tmp_path / "rootfs.img"
    odd.write_bytes(b"\0" * 4096)
    vm = QemuVM(spec(tmp_path, image=str(odd)))
    with pytest.raises(MissingFile, match=f"image {odd} is 4096 bytes, not a multiple of "
                                          "128 MiB.*guest/build.py"):
        await vm.launch()
    assert not os.path.exists(vm.spec.workdir)  # nothing was started


async def test_root_image_is_mapped_shared_and_is_not_guest_ram(tmp_path) -> None:
    """The image is QEMU's shared, read-only mapping of the file (one copy in the host's
    page cache for every pod), and the VM's size counts RAM only."""
    vm = QemuVM(spec(tmp_path))
    await vm.launch()
    try:
        maps = pathlib.Path(f"/proc/{vm.pid}/maps").read_text().splitlines()
        image = [m.split()[1] for m in maps if m.endswith(vm.spec.hypervisor.image)]
        assert image == ["r--s"]
        assert (await vm.size())[1] == 256
    finally:
        await vm.stop()
