"""Taps: their names, and the file descriptors QEMU moves packets through."""
from __future__ import annotations

import fcntl
import os
import re
import struct

from .enter import made_inside

TUNSETIFF = 0x400454CA
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000
IFF_VNET_HDR = 0x4000
TUN = "/dev/net/tun"
VHOST_NET = "/dev/vhost-net"

_NAME = re.compile(r"tap[0-9]+_podvm")


def tap_name(index: int) -> str:
    """The tap for the pod's `index`th interface (at most 15 characters, as the kernel
    wants, for any pod with fewer than 10,000 interfaces)."""
    return f"tap{index}_podvm"


def is_podvm_tap(name: str | None) -> bool:
    return name is not None and _NAME.fullmatch(name) is not None


def open_tap(netns: str, name: str) -> int:
    """A new tap `name` in `netns`, and its file descriptor: frames QEMU writes there
    leave by the tap, with a virtio-net header first (IFF_VNET_HDR, so vhost-net and
    QEMU pass offloads through). The tap is not persistent: the kernel removes it when
    the last descriptor (the shim's, QEMU's) is closed."""
    def make() -> int:
        fd = os.open(TUN, os.O_RDWR | os.O_CLOEXEC)
        try:
            ifreq = struct.pack("16sH22x", name.encode(), IFF_TAP | IFF_NO_PI | IFF_VNET_HDR)
            fcntl.ioctl(fd, TUNSETIFF, ifreq)
        except BaseException:
            os.close(fd)
            raise
        return fd

    return made_inside(netns, make)  # the tun file's namespace is the tap's


def open_vhost() -> int | None:
    """A /dev/vhost-net descriptor for one NIC; None where the host has none. The
    device is not namespaced: QEMU binds it to the tap's descriptor."""
    if not os.path.exists(VHOST_NET):
        return None
    return os.open(VHOST_NET, os.O_RDWR | os.O_CLOEXEC)
