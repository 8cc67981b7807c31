"""shim/libc.py's setup of a helper's child between fork and exec."""
from __future__ import annotations

import resource
import subprocess

from shim.libc import DESCRIPTORS, descriptor_table


def test_a_descriptor_limit_under_the_room_asked_for_still_starts_the_child() -> None:
    """descriptor_table runs in QEMU's child before exec: under a RLIMIT_NOFILE lower
    than the room it asks for, the child still execs (its table grows as it must)."""
    def child() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (DESCRIPTORS // 2, DESCRIPTORS // 2))
        descriptor_table()

    done = subprocess.run(["sh", "-c", "ulimit -n"], preexec_fn=child,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(DESCRIPTORS // 2)
