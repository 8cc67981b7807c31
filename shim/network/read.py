"""Reading what CNI configured in a pod's namespace: its Ethernet interfaces with their
addresses, and the main table's routes through them."""
from __future__ import annotations

import ipaddress
import socket

from pyroute2 import AsyncIPRoute

from .errors import NetworkError
from .model import Address, Interface, PodNetwork, Route
from .netns import rtnl, step
from .tap import is_podvm_tap

ARPHRD_ETHER = 1
RT_TABLE_MAIN = 254
RTN_UNICAST = 1
RTN_MULTICAST = 5
SCOPES = {0: "universe", 200: "site", 253: "link", 254: "host"}
PROTOCOLS = {2: "kernel", 3: "boot", 4: "static", 16: "dhcp", 9: "ra"}


async def read_network(netns: str) -> PodNetwork:
    """The pod's network as CNI left it. NamespaceGone if `netns` names no namespace;
    NetworkError for a route the guest could not be given (multipath, blackhole...)."""
    async with rtnl(netns) as ipr:
        with step(netns, "list interfaces"):
            links = [msg async for msg in await ipr.link("dump")]
        names = {msg["index"]: msg.get("IFLA_IFNAME") for msg in links
                 if msg["ifi_type"] == ARPHRD_ETHER and not is_podvm_tap(msg.get("IFLA_IFNAME"))}
        with step(netns, "list addresses"):
            addresses = await _addresses(ipr, names)
        with step(netns, "list routes"):
            routes = [msg async for msg in await ipr.route("dump")]
    interfaces = tuple(
        Interface(name=names[msg["index"]], mac=msg.get("IFLA_ADDRESS"),
                  mtu=msg.get("IFLA_MTU"), addresses=tuple(addresses.get(msg["index"], ())))
        for msg in sorted(links, key=lambda m: m["index"]) if msg["index"] in names)
    return PodNetwork(netns=netns, interfaces=interfaces,
                      routes=tuple(_routes(netns, routes, names)))


async def _addresses(ipr: AsyncIPRoute, names: dict[int, str]) -> dict[int, list[Address]]:
    found: dict[int, list[Address]] = {}
    async for msg in await ipr.addr("dump"):
        if msg["index"] not in names:
            continue
        ip = msg.get("IFA_LOCAL") or msg.get("IFA_ADDRESS")
        if ip is None or (msg["family"] == socket.AF_INET6
                          and ipaddress.ip_address(ip).is_link_local):
            continue
        found.setdefault(msg["index"], []).append(Address(ip, msg["prefixlen"]))
    return found


def _routes(netns: str, messages: list, names: dict[int, str]) -> list[Route]:
    routes = []
    for msg in messages:
        table = msg.get("RTA_TABLE") or msg["table"]
        if table != RT_TABLE_MAIN or msg["family"] not in (socket.AF_INET, socket.AF_INET6):
            continue
        any_ip = "0.0.0.0" if msg["family"] == socket.AF_INET else "::"
        destination = f"{msg.get('RTA_DST') or any_ip}/{msg['dst_len']}"
        network = ipaddress.ip_network(destination, strict=False)
        if network.is_link_local or network.is_multicast:
            continue  # the guest's kernel makes its own (fe80::/64, ff00::/8)
        if msg.get("RTA_MULTIPATH") is not None:
            raise NetworkError(netns, "list routes", f"route to {destination} has several "
                               "next hops, which podvm cannot give the guest")
        if msg["type"] != RTN_UNICAST:
            if msg["type"] == RTN_MULTICAST:
                continue
            raise NetworkError(netns, "list routes", f"route to {destination} is of type "
                               f"{msg['type']} (not unicast), which podvm cannot give the "
                               "guest")
        device = names.get(msg.get("RTA_OIF"))
        if device is None:
            continue  # through loopback or a device that is not bridged into the VM
        routes.append(Route(
            destination=str(network), device=device, gateway=msg.get("RTA_GATEWAY"),
            scope=SCOPES.get(msg["scope"], str(msg["scope"])), source=msg.get("RTA_PREFSRC"),
            metric=msg.get("RTA_PRIORITY"),
            protocol=PROTOCOLS.get(msg["proto"], str(msg["proto"]))))
    return routes
