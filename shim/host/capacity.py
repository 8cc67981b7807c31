"""This node's CPUs and memory, as the plan's limits take them (shim/resources/model.py,
Host)."""
from __future__ import annotations

import os

from ..resources import Host


def capacity() -> Host:
    """This machine's CPUs and memory, for the plan's limits."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return Host(cpus=os.cpu_count() or 1, memory_mib=int(line.split()[1]) // 1024)
    raise OSError("no MemTotal in /proc/meminfo")
