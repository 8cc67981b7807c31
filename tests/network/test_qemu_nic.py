"""QEMU takes a TapNic as it is given: its arguments and descriptors make a virtio-net
device with the interface's MAC and MTU on the tap (a paused q35 machine, no guest)."""
from __future__ import annotations

import subprocess

from shim.network.attach import attach
from shim.network.detach import detach
from shim.network.read import read_network
from testbed.prereqs import require_tool
from tests.network.conftest import POD_MAC, Namespace


async def test_qemu_accepts_the_nic(pod: Namespace) -> None:
    qemu = require_tool("qemu-system-x86_64", "qemu-system-x86")
    nics = await attach(await read_network(pod.path))
    try:
        argv = [qemu, "-machine", "q35,accel=tcg", "-S", "-nodefaults", "-display", "none",
                "-monitor", "stdio"]
        for nic in nics:
            argv += nic.qemu_args()
        done = subprocess.run(argv, input="info network\ninfo qtree\nquit\n", capture_output=True,
                              text=True, timeout=60,
                              pass_fds=[fd for nic in nics for fd in nic.fds])
    finally:
        for nic in nics:
            nic.close()
        await detach(pod.path)
    assert done.returncode == 0, done.stderr
    info = done.stdout.replace("\r", "")
    assert (f"type=nic,model=virtio-net-pci,macaddr={POD_MAC}\n"
            f" \\ net0: index=0,type=tap,fd={nics[0].tap_fd}\n") in info, info
    assert "host_mtu = 1400 (0x578)" in info, info
