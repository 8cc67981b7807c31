"""The pod's network in the guest: each virtio-net device the host gave the VM (found by
the MAC address the host set on it) renamed to the pod interface's name, with its MTU,
addresses and routes, before any container runs. Containers share the guest's network
namespace, which is therefore the pod's.

The changes are rtnetlink requests the agent makes itself (rtnetlink.py), each written as
the `ip` command that would make it. IPv6 addresses skip duplicate address detection
through the interface's `accept_dad` sysctl (the host's namespace already owns them;
waiting for DAD would only delay the pod).

`plan()` is pure (the request and the guest's devices in, the steps out); `configure()`
carries the steps out. Every step is idempotent (`replace`, not `add`), so the whole is."""
from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass
from typing import NoReturn  # asyncio loads typing anyway

from podvm_core.pb.agent import agent_pb2 as pb
from podvm_core.ttrpc import Code, TtrpcError

from .rtnetlink import AddressReplace, LinkSet, Netlink, Request, RouteReplace

log = logging.getLogger("podvm.agent")

SYS_NET = "/sys/class/net"
ARPHRD_ETHER = "1"
IFNAMSIZ = 16
SCOPES = {"": "global", "universe": "global", "global": "global", "site": "site",
          "link": "link", "host": "host"}
"""The model's scope names as `ip` spells them (rtnetlink.SCOPES has no "universe")."""


@dataclass(frozen=True)
class Step:
    subject: str
    """What the step configures, for its error: "interface eth0", "route default via..."."""
    request: Request | None = None
    sysctl: tuple[str, str] | None = None
    """(path under /proc/sys, value) written instead of a request."""

    def __str__(self) -> str:
        if self.sysctl is not None:
            return f"{self.sysctl[0]} = {self.sysctl[1]}"
        return str(self.request)


def plan(req: pb.ConfigureNetworkRequest, links: dict[str, str]) -> list[Step]:
    """The steps that make the guest's devices (`links`: name -> MAC, lower case) match
    `req`: renames (down, rename), IPv6 DAD off, MTU and up, addresses, then routes, the
    ones on a link before the ones through a gateway (which need them). INVALID_ARGUMENT
    for a malformed request, FAILED_PRECONDITION when the guest lacks a device."""
    _validate(req)
    by_mac = {mac: name for name, mac in links.items()}
    current: dict[str, str] = {}  # wanted name -> the device's name now
    for itf in req.interfaces:
        name = by_mac.get(itf.mac.lower())
        if name is None:
            raise TtrpcError(Code.FAILED_PRECONDITION, (
                f"interface {itf.name}: the guest has no network device with MAC {itf.mac} "
                f"(it has {_describe(links)}): is virtio_net in the guest image?"))
        current[itf.name] = name
    steps: list[Step] = []
    renamed = {want: now for want, now in current.items() if want != now}
    moving = set(renamed.values())
    for want in renamed:
        if want in links and want not in moving:
            raise TtrpcError(Code.FAILED_PRECONDITION, (
                f"interface {want}: the guest's device {want} ({links[want]}) is none of "
                "the pod's and holds that name"))
    # A wanted name that another renamed device holds now: every renamed device goes
    # through a name of its own first, so that devices can swap names.
    clash = any(want in moving for want in renamed)
    origin = dict(renamed)
    for i, (want, now) in enumerate(renamed.items()):
        subject = f"interface {want} ({now} in the guest)"
        steps.append(Step(subject, LinkSet(now, up=False)))
        if clash:
            temporary = f"podvm-rename{i}"
            steps.append(Step(subject, LinkSet(now, name=temporary)))
            renamed[want] = temporary
    for want, now in renamed.items():
        steps.append(Step(f"interface {want} ({origin[want]} in the guest)",
                          LinkSet(now, name=want)))
    for itf in req.interfaces:
        subject = f"interface {itf.name}"
        if any(":" in a.address for a in itf.addresses):
            steps.append(Step(subject, sysctl=(f"net/ipv6/conf/{itf.name}/accept_dad", "0")))
        steps.append(Step(subject, LinkSet(itf.name, up=True, mtu=itf.mtu)))
        for a in itf.addresses:
            steps.append(Step(f"address {a.address}/{a.prefix_len} on {itf.name}",
                              AddressReplace(itf.name, a.address, a.prefix_len)))
    on_link = [r for r in req.routes if not r.gateway]
    via_gateway = [r for r in req.routes if r.gateway]
    for r in on_link + via_gateway:
        scope = SCOPES.get(r.scope, r.scope) if r.scope else ""
        steps.append(Step(f"route {describe_route(r)}", RouteReplace(
            r.destination, r.device, r.gateway, "" if scope == "global" else scope,
            r.source, r.metric)))
    return steps


def describe_route(r: pb.NetworkRoute) -> str:
    return r.destination + (f" via {r.gateway}" if r.gateway else "") + f" dev {r.device}"


async def configure(req: pb.ConfigureNetworkRequest) -> None:
    """Carry out `plan(req, <the guest's devices>)`; the first step that fails ends it
    with an error that names what it configured and the kernel's answer."""
    started = time.monotonic()
    steps = plan(req, links())
    with Netlink() as netlink:
        for step in steps:
            _apply(netlink, step)
    log.info("network: %s configured (%d addresses, %d routes) in %.3fs, %d steps",
             ", ".join(i.name for i in req.interfaces),
             sum(len(i.addresses) for i in req.interfaces), len(req.routes),
             time.monotonic() - started, len(steps))


def links() -> dict[str, str]:
    """The guest's Ethernet devices: name -> MAC."""
    found = {}
    for name in os.listdir(SYS_NET):
        try:
            with open(f"{SYS_NET}/{name}/type") as f:
                if f.read().strip() != ARPHRD_ETHER:
                    continue
            with open(f"{SYS_NET}/{name}/address") as f:
                found[name] = f.read().strip().lower()
        except OSError:
            continue  # gone meanwhile
    return found


def _apply(netlink: Netlink, step: Step) -> None:
    try:
        if step.sysctl is not None:
            path, value = step.sysctl
            with open(f"/proc/sys/{path}", "w") as f:
                f.write(value)
        else:
            assert step.request is not None
            netlink.apply(step.request)
    except OSError as exc:
        raise TtrpcError(Code.FAILED_PRECONDITION,
                         f"guest network, {step.subject}: `{step}` failed: "
                         f"{exc.strerror or exc}") from None


def _validate(req: pb.ConfigureNetworkRequest) -> None:
    names = set()
    macs = set()
    for itf in req.interfaces:
        if not itf.name or len(itf.name) >= IFNAMSIZ or itf.name in (".", "..") or \
                any(c in itf.name for c in "/: \t\n"):
            _invalid(f"interface name {itf.name!r} is not a Linux interface name")
        if itf.name in names:
            _invalid(f"interface {itf.name} is given twice")
        names.add(itf.name)
        parts = itf.mac.split(":")
        if len(parts) != 6 or not all(len(p) == 2 and _is_hex(p) for p in parts):
            _invalid(f"interface {itf.name}: MAC {itf.mac!r} is not aa:bb:cc:dd:ee:ff")
        if itf.mac.lower() in macs:
            _invalid(f"interface {itf.name}: MAC {itf.mac} is given twice")
        macs.add(itf.mac.lower())
        if itf.mtu and not 68 <= itf.mtu <= 65535:
            _invalid(f"interface {itf.name}: MTU {itf.mtu} is out of range (68-65535)")
        for a in itf.addresses:
            _check_prefix(a.address, a.prefix_len, f"interface {itf.name}: address")
    for r in req.routes:
        what = f"route {describe_route(r)}"
        address, _, prefix = r.destination.partition("/")
        if not prefix.isdigit():
            _invalid(f"{what}: destination {r.destination!r} has no /prefix length")
        family = _check_prefix(address, int(prefix), f"{what}: destination")
        if r.device not in names:
            _invalid(f"{what}: device {r.device!r} is none of the interfaces "
                     f"({', '.join(sorted(names)) or 'none given'})")
        for field, value in (("gateway", r.gateway), ("source", r.source)):
            if value and _family(value) != family:
                version = 4 if family == socket.AF_INET else 6
                _invalid(f"{what}: {field} {value!r} is not an IPv{version} address")
        if r.scope not in SCOPES and not (r.scope.isdigit() and int(r.scope) < 256):
            _invalid(f"{what}: scope {r.scope!r} is none of {', '.join(sorted(SCOPES)[1:])} "
                     "or a number below 256")


def _check_prefix(address: str, prefix_len: int, what: str) -> int:
    family = _family(address)
    if family is None:
        _invalid(f"{what} {address!r} is not an IP address")
    if prefix_len > (32 if family == socket.AF_INET else 128):
        _invalid(f"{what} {address}/{prefix_len}: the prefix length is too long")
    return family


def _family(address: str) -> int | None:
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            socket.inet_pton(family, address)
            return family
        except (OSError, ValueError):
            continue
    return None


def _is_hex(text: str) -> bool:
    return all(c in "0123456789abcdefABCDEF" for c in text)


def _invalid(message: str) -> NoReturn:
    raise TtrpcError(Code.INVALID_ARGUMENT, f"guest network: {message}")


def _describe(links: dict[str, str]) -> str:
    return ", ".join(f"{n} {m}" for n, m in sorted(links.items())) or "no Ethernet device"
