"""A pod's network as values: what CNI configured in the pod's namespace (persisted with
the pod, sent to the guest agent, which sets up the guest's interfaces to match), and the
taps QEMU gets for it.

Frozen dataclasses of str, int, None and tuples only, so that `dataclasses.asdict()` is
their JSON and shim/dataclassjson.py rebuilds them field by field."""
from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Address:
    address: str
    """"10.88.0.5", "fd00::5" (IPv6 link-local addresses are never listed: the guest's
    kernel makes its own)."""
    prefix_len: int

    @property
    def version(self) -> int:
        return ipaddress.ip_address(self.address).version

    def __str__(self) -> str:
        return f"{self.address}/{self.prefix_len}"


@dataclass(frozen=True)
class Route:
    """A unicast route of the namespace's main table."""
    destination: str
    """A network with its prefix length: "10.88.0.0/16"; the default route is "0.0.0.0/0"
    or "::/0"."""
    device: str
    """The interface (one of `PodNetwork.interfaces`) the route leaves by."""
    gateway: str | None = None
    scope: str = "universe"
    """"universe", "site", "link" or "host" (a number for any other)."""
    source: str | None = None
    """The preferred source address (`src`), when set."""
    metric: int | None = None
    protocol: str = "boot"
    """Who made it: "kernel" for the route an address brings by itself (the guest's kernel
    makes it too when the address is added), "boot" (`ip route add`, CNI), "static",
    "dhcp"... (a number for any other)."""

    @property
    def is_default(self) -> bool:
        return ipaddress.ip_network(self.destination).prefixlen == 0

    @property
    def version(self) -> int:
        return ipaddress.ip_network(self.destination).version


@dataclass(frozen=True)
class Interface:
    """An Ethernet interface CNI configured (loopback, tunnels' fallback devices and
    podvm's own taps are not listed)."""
    name: str
    mac: str
    """"02:42:0a:58:00:05": the guest's virtio-net device gets it, so peers that resolved
    the pod's address reach the guest."""
    mtu: int
    addresses: tuple[Address, ...] = ()


@dataclass(frozen=True)
class PodNetwork:
    netns: str
    """The namespace's path: /var/run/netns/cni-<uuid>, /proc/<pid>/ns/net."""
    interfaces: tuple[Interface, ...] = ()
    routes: tuple[Route, ...] = ()

    def interface(self, name: str) -> Interface:
        for itf in self.interfaces:
            if itf.name == name:
                return itf
        raise KeyError(name)


def nic_device(index: int, mac: str, mtu: int) -> str:
    """QEMU's virtio-net device on netdev `net<index>`. `romfile=` (empty): no iPXE option
    ROM, which a guest booted from its kernel never runs (less guest memory, no ipxe-qemu
    needed)."""
    return f"virtio-net-pci,netdev=net{index},mac={mac},host_mtu={mtu},romfile="


@dataclass(frozen=True)
class TapNic:
    """One interface of the pod bridged to a tap: what QEMU needs to give the guest a NIC
    on it. The shim owns the file descriptors until `close()`: QEMU gets them with
    `pass_fds` (same numbers in the child), after which the shim closes its copies."""
    index: int
    """N in QEMU's `netN` ids: the interface's position in `PodNetwork.interfaces`."""
    interface: str
    tap: str
    """The tap's name in the pod's namespace: persisted, so `delete` removes it after a
    crash."""
    mac: str
    mtu: int
    tap_fd: int
    vhost_fd: int | None = None
    """/dev/vhost-net opened for this NIC; None where the host has no vhost-net (QEMU then
    moves the packets itself)."""

    @property
    def netdev_id(self) -> str:
        return f"net{self.index}"  # as nic_device() names it

    @property
    def fds(self) -> tuple[int, ...]:
        """For QEMU's `pass_fds`."""
        return (self.tap_fd,) if self.vhost_fd is None else (self.tap_fd, self.vhost_fd)

    def qemu_args(self, mac: str = "") -> list[str]:
        """The netdev and the device; `mac`: the device's instead of the pod's (a VM
        restored from a template has the template's until the agent sets the pod's)."""
        netdev = f"tap,id={self.netdev_id},fd={self.tap_fd}"
        if self.vhost_fd is not None:
            netdev += f",vhost=on,vhostfd={self.vhost_fd}"
        return ["-netdev", netdev, "-device", nic_device(self.index, mac or self.mac, self.mtu)]

    def close(self) -> None:
        """Close the shim's copies (idempotence is the caller's: call it once)."""
        for fd in self.fds:
            os.close(fd)


@dataclass(frozen=True)
class PlaceholderNic:
    """A NIC with nothing behind it, for a template VM: the pods restored from the
    template bring the taps. Same device as TapNic's. Its backend is a UDP socket on
    loopback (to the discard port; the template's guest never brings the link up): a
    hub port of its own hangs QEMU 7.2 before the guest's first word."""
    index: int
    mtu: int
    fds: tuple[int, ...] = ()

    def qemu_args(self, mac: str) -> list[str]:
        return ["-netdev", f"socket,id=net{self.index},udp=127.0.0.1:9,localaddr=127.0.0.1:0",
                "-device", nic_device(self.index, mac, self.mtu)]

    def close(self) -> None:
        pass
