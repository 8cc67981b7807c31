"""CPU and memory hot-plug on a real QEMU (TCG) with the real guest: QEMU's view and the
guest's agree after each step; under TCG the vCPUs are all plugged at boot and grow by
going online; a shrink takes vCPUs offline in the guest."""
from __future__ import annotations

import dataclasses

import pytest

from shim.vm.agent import Agent
from shim.vm.hypervisor import HypervisorError, ThreadRole
from shim.vm.qemu.driver import QemuVM

from tests.vm.test_qemu import spec

MIB = 1 << 20


async def test_vcpu_and_memory_hot_plug_and_vcpus_offline(tmp_path) -> None:
    vm = QemuVM(dataclasses.replace(spec(tmp_path, boot_timeout=90), vcpus=1, max_vcpus=2))
    await vm.launch()
    try:
        agent = Agent.of_vm(vm)
        info = await agent.ping(timeout=60)
        # Under TCG both vCPUs are plugged at boot (a vCPU thread started later can
        # abort QEMU 7.2) and the guest brings up one; growing onlines the other.
        assert (info.online_cpus, await vm.size()) == (1, (2, 256))
        assert len((await vm.threads())[ThreadRole.VCPU]) == 2
        with pytest.raises(HypervisorError, match="only 0 of 2 slots are free"):
            await vm.add_vcpus(1)
        assert (await agent.online(cpus=2)).online_cpus == 2

        memory = info.memory_total_bytes
        for mib, total in ((128, 384), (256, 640)):
            assert await vm.add_memory(mib) == mib
            assert await vm.size() == (2, total)
            grown = await agent.online(cpus=2, wait_memory_bytes=memory + mib * MIB)
            assert grown.memory_total_bytes == memory + mib * MIB
            memory = grown.memory_total_bytes
        # A DIMM that is not whole 128 MiB blocks is not usable by the guest and
        # misaligns every later one: refused before QEMU sees it.
        with pytest.raises(HypervisorError, match="multiples of 128 MiB, not 64"):
            await vm.add_memory(64)
        with pytest.raises(HypervisorError, match="has 640 MiB and may grow to 1024 MiB"):
            await vm.add_memory(512)

        # Shrinking takes the vCPU offline in the guest; QEMU keeps it plugged.
        assert (await agent.online(cpus=1)).online_cpus == 1 and (await vm.size())[0] == 2
        assert (await agent.online(cpus=2)).online_cpus == 2  # and back

        await agent.close()
    finally:
        await vm.stop()
