"""Which VMM makes a pod's VM: the one place that names an implementation of the
hypervisor interface (shim/vm/hypervisor.py), so that the interface never imports its
drivers. QEMU is the one podvm has."""
from __future__ import annotations

from .hypervisor import VM, VMSpec
from .qemu.driver import QemuVM


def create(spec: VMSpec) -> VM:
    """The VM `spec` describes, not started yet."""
    return QemuVM(spec)
