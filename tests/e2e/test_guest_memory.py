"""The guest gets the memory its VM is sized for (issue 15): MemTotal inside the guest,
read by a container through the CRI, is at most 64 MiB below the VM's size, whatever
the size; `podvmctl status` shows both and the difference. Real containerd, real QEMU."""
from __future__ import annotations

import pytest

from podvmctl import status
from testbed.containerd import CRI_NAMESPACE
from testbed.prereqs import require_root

from .test_pod_resources import guest_size, remove_pod, resources, run_pod, start_containerd

MIB = 1 << 20
KERNEL_KEEPS_AT_MOST_MIB = 64


@pytest.fixture(scope="module")
def ctd(tmp_path_factory, image_cache):
    require_root()
    c = start_containerd(tmp_path_factory.mktemp("podvm-guestmem"), image_cache,
                         {"static_sandbox_resource_mgmt": True}, default_maxmemory=2048)
    try:
        yield c
    finally:
        c.stop()


@pytest.mark.parametrize("vm_mib", [256, 1024])  # the default size, and four times it
def test_memtotal_is_the_vm_size_less_at_most_64_mib(ctd, tmp_path, vm_mib) -> None:
    limit = (vm_mib - 256) * MIB  # the VM is default_memory (256) + the pod's limit
    crictl, pod_id, cid, _ = run_pod(ctd, tmp_path, f"mem{vm_mib}",
                                     resources(memory=limit) if limit else None,
                                     resources(memory=limit) if limit else None)
    try:
        _, memtotal = guest_size(crictl, cid)
        assert vm_mib - KERNEL_KEEPS_AT_MOST_MIB <= memtotal < vm_mib
        report = status.collect(status.find(pod_id, CRI_NAMESPACE))
        assert report["vm"]["qemu_memory_mib"] == vm_mib
        assert report["vm"]["memory_total_mib"] == memtotal
        assert (f"{vm_mib} MiB; the guest has 1 vCPUs online, MemTotal {memtotal} MiB "
                f"({vm_mib - memtotal} MiB less" in status.render(report))
    finally:
        remove_pod(ctd, crictl, pod_id)
