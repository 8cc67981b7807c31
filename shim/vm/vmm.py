"""Which VMM makes a pod's VM: the one place that names an implementation of the
hypervisor interface (shim/vm/hypervisor.py), so that the interface never imports its
drivers. QEMU is the one podvm has.

PODVM_TEST_VMM=fake in the shim's environment makes every VM a FakeVM instead (testbed/
fakevm.py: a host process with QEMU's threads and an agent that runs containers' commands
on the host, unconfined), for the tests of what the host does with a VM. testbed/ is
never installed on a node (neither the wheel nor podvm-node's bundle has it): there the
variable fails every pod's boot, with that said, before anything is made
(docs/threat-model.md). Any other value of it fails the same way."""
from __future__ import annotations

import os

from .hypervisor import VM, HypervisorError, VMSpec
from .qemu.driver import QemuVM

TEST_VMM = "PODVM_TEST_VMM"


def create(spec: VMSpec) -> VM:
    """The VM `spec` describes, not started yet."""
    wanted = os.environ.get(TEST_VMM, "")
    if not wanted:
        return QemuVM(spec)
    if wanted != "fake":
        raise HypervisorError(f"{TEST_VMM}={wanted!r} names no VMM (the tests' \"fake\" "
                              f"is the one it may name): unset it")
    try:
        # the tests' double, only where a test selects it: nodes do not have it
        from testbed.fakevm import FakeVM
    except ImportError as exc:
        raise HypervisorError(f"{TEST_VMM}=fake selects the tests' fake VM, which is not "
                              f"installed here ({exc}): nothing was booted; unset "
                              f"{TEST_VMM} in the shim's environment") from None
    return FakeVM(spec)
