"""Processes by pid, read from /proc with the standard library alone: whether one is a
podvm shim, when one started. `delete` asks both of every pod's shim it meets, and loads
psutil (shim/host/processes.py) only when it has one to kill."""
from __future__ import annotations

SHIM_BINARY = "containerd-shim-podvm-v2"


def is_our_shim(pid: int) -> bool:
    """A live process with the shim's binary in an argument of its command line (a zombie
    has none; a pid that is gone or not ours to read is no shim of ours)."""
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
    except OSError:
        return False
    return SHIM_BINARY.encode() in cmdline


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot, which tells a live process from
    a later one that got its pid; None when it is gone or a zombie."""
    if pid <= 0:
        return None
    try:
        # Not psutil's create_time(): it adds the boot time as the clock has it now, so the
        # value moves when NTP steps the clock; this one is compared across processes/hours.
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if not fields or fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])
