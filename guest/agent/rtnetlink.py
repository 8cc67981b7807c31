"""The few rtnetlink requests the agent makes for a pod's network (guest/agent/network.py),
built with struct and sent on a NETLINK_ROUTE socket: a device's state, MTU and name, an
address, a route, each replaced as `ip ... replace` would. Running busybox `ip` instead
cost a process per request (0.18 s for a pod with one interface under TCG, against 0.09 s
in all), and pyroute2, which would do it, is not in the guest image (importing it costs
about a second of every boot under TCG).

Each request reads as the `ip` command that makes the same change (its str()), for the
log and for errors; `Netlink.apply()` carries it out, or raises OSError with the kernel's
errno. Devices are named, and found by name when the request is made: a rename earlier in
the same configuration is seen."""
from __future__ import annotations

import errno
import os
import socket
import struct
from dataclasses import dataclass

NLMSG_ERROR = 2
RTM_NEWLINK, RTM_NEWADDR, RTM_NEWROUTE = 16, 20, 24
NLM_F_REQUEST, NLM_F_ACK, NLM_F_REPLACE, NLM_F_CREATE = 0x1, 0x4, 0x100, 0x400
IFLA_ADDRESS, IFLA_IFNAME, IFLA_MTU = 1, 3, 4
IFF_UP = 0x1
IFA_ADDRESS, IFA_LOCAL = 1, 2
RTA_DST, RTA_OIF, RTA_GATEWAY, RTA_PRIORITY, RTA_PREFSRC = 1, 4, 5, 6, 7
RT_TABLE_MAIN, RTPROT_BOOT, RTN_UNICAST = 254, 3, 1
SCOPES = {"global": 0, "site": 200, "link": 253, "host": 254}
"""`ip`'s scope names; a number stands for itself."""

_HEADER = struct.Struct("=IHHII")  # nlmsghdr: length, type, flags, sequence, port
_IFINFO = struct.Struct("=BxHiII")  # ifinfomsg: family, type, index, flags, change
_IFADDR = struct.Struct("=BBBBI")  # ifaddrmsg: family, prefix length, flags, scope, index
_RTMSG = struct.Struct("=BBBBBBBBI")  # rtmsg: family, dst/src length, tos, table, protocol,
#                                       scope, type, flags


@dataclass(frozen=True)
class LinkSet:
    """`ip link set dev DEVICE [address MAC] [mtu MTU] [up|down] [name NAME]`."""
    device: str
    up: bool | None = None
    mtu: int = 0
    name: str = ""
    address: str = ""
    """aa:bb:cc:dd:ee:ff"""

    def __str__(self) -> str:
        return " ".join(["ip link set dev", self.device,
                         *(["address", self.address] if self.address else []),
                         *(["mtu", str(self.mtu)] if self.mtu else []),
                         *([] if self.up is None else ["up" if self.up else "down"]),
                         *(["name", self.name] if self.name else [])])

    def message(self) -> tuple[int, int, bytes]:
        flags = IFF_UP if self.up else 0
        change = IFF_UP if self.up is not None else 0
        body = _IFINFO.pack(socket.AF_UNSPEC, 0, _index(self.device), flags, change)
        if self.address:
            body += _attr(IFLA_ADDRESS, bytes.fromhex(self.address.replace(":", "")))
        if self.mtu:
            body += _attr(IFLA_MTU, struct.pack("=I", self.mtu))
        if self.name:
            body += _attr(IFLA_IFNAME, self.name.encode() + b"\0")
        return RTM_NEWLINK, 0, body


@dataclass(frozen=True)
class AddressReplace:
    """`ip addr replace ADDRESS/PREFIX dev DEVICE`."""
    device: str
    address: str
    prefix_len: int

    def __str__(self) -> str:
        return f"ip addr replace {self.address}/{self.prefix_len} dev {self.device}"

    def message(self) -> tuple[int, int, bytes]:
        family, raw = _address(self.address)
        scope = SCOPES["host"] if family == socket.AF_INET and raw[0] == 127 else 0
        body = _IFADDR.pack(family, self.prefix_len, 0, scope, _index(self.device))
        body += _attr(IFA_LOCAL, raw) + _attr(IFA_ADDRESS, raw)
        return RTM_NEWADDR, NLM_F_CREATE | NLM_F_REPLACE, body


@dataclass(frozen=True)
class RouteReplace:
    """`ip [-6] route replace DESTINATION [via GATEWAY] dev DEVICE [scope SCOPE]
    [src SOURCE] [metric METRIC]`, in the main table; without a scope, a route through
    a gateway is global and one without is on the link, as `ip` has it."""
    destination: str
    device: str
    gateway: str = ""
    scope: str = ""
    source: str = ""
    metric: int = 0

    def __str__(self) -> str:
        words = ["ip", *(["-6"] if ":" in self.destination else []), "route replace",
                 self.destination]
        words += ["via", self.gateway] if self.gateway else []
        words += ["dev", self.device]
        words += ["scope", self.scope] if self.scope else []
        words += ["src", self.source] if self.source else []
        words += ["metric", str(self.metric)] if self.metric else []
        return " ".join(words)

    def message(self) -> tuple[int, int, bytes]:
        address, _, prefix = self.destination.partition("/")
        family, raw = _address(address)
        if self.scope:
            scope = int(self.scope) if self.scope.isdigit() else SCOPES[self.scope]
        else:
            scope = 0 if self.gateway else SCOPES["link"]
        body = _RTMSG.pack(family, int(prefix), 0, 0, RT_TABLE_MAIN, RTPROT_BOOT, scope,
                           RTN_UNICAST, 0)
        if int(prefix):
            body += _attr(RTA_DST, raw)
        if self.gateway:
            body += _attr(RTA_GATEWAY, _address(self.gateway)[1])
        body += _attr(RTA_OIF, struct.pack("=i", _index(self.device)))
        if self.source:
            body += _attr(RTA_PREFSRC, _address(self.source)[1])
        if self.metric:
            body += _attr(RTA_PRIORITY, struct.pack("=I", self.metric))
        return RTM_NEWROUTE, NLM_F_CREATE | NLM_F_REPLACE, body


Request = LinkSet | AddressReplace | RouteReplace


class Netlink:
    """A NETLINK_ROUTE socket that makes one request at a time and waits for its ack."""

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE)
        self._sock.bind((0, 0))
        self._sequence = 0

    def __enter__(self) -> Netlink:
        return self

    def __exit__(self, *_) -> None:
        self._sock.close()

    def apply(self, request: Request) -> None:
        """Make the change, or raise OSError with the kernel's answer (a device not found
        by name: ENODEV)."""
        kind, flags, body = request.message()
        self._sequence += 1
        self._sock.send(_HEADER.pack(_HEADER.size + len(body), kind,
                                     NLM_F_REQUEST | NLM_F_ACK | flags, self._sequence, 0)
                        + body)
        while True:
            data = self._sock.recv(65536)
            offset = 0
            while offset + _HEADER.size <= len(data):
                length, kind, _, sequence, _ = _HEADER.unpack_from(data, offset)
                if kind == NLMSG_ERROR and sequence == self._sequence:
                    (error,) = struct.unpack_from("=i", data, offset + _HEADER.size)
                    if error:
                        raise OSError(-error, os.strerror(-error))
                    return
                offset += (length + 3) & ~3 or len(data)


def _attr(kind: int, payload: bytes) -> bytes:
    length = 4 + len(payload)
    return struct.pack("=HH", length, kind) + payload + b"\0" * (-length % 4)


def _address(text: str) -> tuple[int, bytes]:
    family = socket.AF_INET6 if ":" in text else socket.AF_INET
    return family, socket.inet_pton(family, text)


def _index(device: str) -> int:
    try:
        return socket.if_nametoindex(device)
    except OSError:
        raise OSError(errno.ENODEV, f"no device {device}") from None
