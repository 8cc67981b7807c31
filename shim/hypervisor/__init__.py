"""Hypervisor drivers: one interface, one implementation per VMM (QEMU today)."""
from .base import BootTimeout, HypervisorError, MissingFile, ThreadRole, VM, VMSpec

__all__ = ["BootTimeout", "HypervisorError", "MissingFile", "ThreadRole", "VM", "VMSpec"]
