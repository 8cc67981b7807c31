"""The QEMU driver on a real QEMU (TCG) with the real guest image."""
from __future__ import annotations

import os
import pathlib

import pytest

from shim.agent import Agent
from shim.hypervisor import BootTimeout, MissingFile, ThreadRole, VMSpec
from shim.hypervisor.qemu import QemuVM
from tests.conftest import require, require_root
from tests.vmconfig import vm_config


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
        assert len(roles[ThreadRole.VCPU]) == 2
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


async def test_kvm_boot_timeout_names_the_accel_setting(tmp_path) -> None:
    require(os.path.exists("/dev/kvm"), "/dev/kvm")
    # 1 s: no guest reaches its agent that fast, and under nested KVM it never does.
    vm = QemuVM(spec(tmp_path, accel="kvm", boot_timeout=1))
    with pytest.raises(BootTimeout) as err:
        await vm.launch()
    message = str(err.value)
    assert "accel=kvm" in message and 'accel = "tcg"' in message and "/etc/x.toml" in message
    assert vm._proc is not None and vm._proc.returncode is not None  # killed


async def test_missing_kernel_is_named(tmp_path) -> None:
    vm = QemuVM(spec(tmp_path, kernel="/nonexistent/vmlinux"))
    with pytest.raises(MissingFile, match="kernel /nonexistent/vmlinux does not exist.*"
                                          "/etc/x.toml"):
        await vm.launch()
