"""Hypervisor drivers: one interface, one implementation per VMM (QEMU today)."""
from .base import (BootTimeout, CannotGrow, HypervisorError, MissingFile, RestoreFailed,
                   ThreadRole, VM, VMExited, VMSpec)

__all__ = ["BootTimeout", "CannotGrow", "HypervisorError", "MissingFile", "RestoreFailed",
           "ThreadRole", "VM", "VMExited", "VMSpec"]
