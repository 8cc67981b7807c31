"""The hypervisor interface is the way in: `vmm.create()` makes the VM a spec describes (QEMU's
today), and a template's NICs are named by the interface, the same in the VMM's command
line as in what the guest is told at Resume. Nothing is booted here."""
from __future__ import annotations

import dataclasses

from shim.network.model import PlaceholderNic
from shim.vm import vmm
from shim.vm.qemu import command as qemu_command
from shim.vm.hypervisor import VM, template_mac
from tests.vm.test_qemu import spec


def test_create_makes_the_vm_the_spec_describes(tmp_path) -> None:
    s = spec(tmp_path)
    vm = vmm.create(s)
    assert isinstance(vm, VM) and vm.spec is s
    assert vm.command() == qemu_command.command(s)
    assert vm.control_socket in " ".join(vm.command())
    vm.check_files()  # the test image is complete


def test_a_template_s_nics_have_the_interface_s_macs(tmp_path) -> None:
    s = dataclasses.replace(spec(tmp_path), template=True,
                            nics=(PlaceholderNic(0, 1500), PlaceholderNic(1, 1500)))
    line = " ".join(vmm.create(s).command())
    assert template_mac(0) in line and template_mac(1) in line
    assert template_mac(0) != template_mac(1)


def test_the_scratch_disk_is_qemu_s_descriptor_found_by_its_serial(tmp_path) -> None:
    s = dataclasses.replace(spec(tmp_path), scratch_disk="/proc/self/fd/9")
    line = " ".join(qemu_command.command(s))
    assert ("driver=file,node-name=scratch,filename=/proc/self/fd/9,cache.direct=on,"
            "cache.no-flush=on,discard=unmap") in line
    assert f"virtio-blk-pci,drive=scratch,id=scratch,serial={qemu_command.SCRATCH_SERIAL}" \
        in line
    without = dataclasses.replace(spec(tmp_path, scratch_disk_mib=0), scratch_disk="")
    assert "virtio-blk" not in " ".join(qemu_command.command(without))


def test_tcg_hides_the_byte_wise_string_copies_kvm_gives_the_host_cpu(tmp_path) -> None:
    """Under TCG the guest's CPU has no ERMS or FSRM (TCG runs `rep movsb` a byte at a
    time: every copy the guest makes would); under KVM it is the host's."""
    tcg = vmm.create(spec(tmp_path)).command()
    assert tcg[tcg.index("-cpu") + 1] == "max,erms=off,fsrm=off"
    kvm = vmm.create(spec(tmp_path, accel="kvm")).command()
    assert kvm[kvm.index("-cpu") + 1] == "host"
