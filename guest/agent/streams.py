"""A process's pipes and ptys in the guest: podvm_core's FdStream, the same non-blocking
fd I/O as the shim's copies to containerd's FIFOs."""
from __future__ import annotations

from podvm_core.fdio import FdStream as Stream

__all__ = ["Stream"]
