"""Real network namespaces, made and checked with iproute2 (another netlink
implementation than the one under test). Each test gets its own namespaces with unique
names: `pod` (where CNI would have put eth0) and `peer` (the veth's other end, standing for
the node's bridge); both are deleted afterwards, failure or not, and every device in them
goes with them. No traffic ever leaves them."""
from __future__ import annotations

import contextlib
import json
import os
import secrets
import subprocess
from dataclasses import dataclass
from typing import Iterator

import pytest

from testbed.prereqs import require, require_root, require_tool

POD_MAC = "02:00:0a:09:00:02"
PEER_MAC = "02:00:0a:09:00:01"


@dataclass(frozen=True)
class Namespace:
    name: str

    @property
    def path(self) -> str:
        return f"/var/run/netns/{self.name}"

    def ip(self, *args: str) -> str:
        return _run("ip", "-n", self.name, *args)

    def tc(self, *args: str) -> str:
        return _run("tc", "-n", self.name, *args)

    def delete(self) -> None:
        _run("ip", "netns", "delete", self.name)

    def links(self) -> dict[str, dict]:
        return {link["ifname"]: link for link in json.loads(self.ip("-j", "-d", "link", "show"))}

    def qdiscs(self, dev: str) -> list[dict]:
        return json.loads(self.tc("-j", "qdisc", "show", "dev", dev))

    def ingress_filters(self, dev: str) -> list[dict]:
        """The u32 filters of the device's ingress that hold actions."""
        return [f for f in json.loads(self.tc("-j", "filter", "show", "dev", dev, "ingress"))
                if "actions" in f.get("options", {})]


def _run(*argv: str) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise AssertionError(f"{' '.join(argv)}: {done.stderr.strip()}")
    return done.stdout


@contextlib.contextmanager
def _namespace() -> Iterator[Namespace]:
    require_root()
    require_tool("ip", "iproute2")
    require(os.path.exists("/dev/net/tun"), "/dev/net/tun (the tun driver)")
    ns = Namespace(f"podvmt-{secrets.token_hex(4)}")
    _run("ip", "netns", "add", ns.name)
    try:
        yield ns
    finally:
        subprocess.run(["ip", "netns", "delete", ns.name], capture_output=True, timeout=30)


@pytest.fixture
def peer() -> Iterator[Namespace]:
    with _namespace() as ns:
        yield ns


@pytest.fixture
def pod(peer: Namespace) -> Iterator[Namespace]:
    """eth0 as CNI leaves it: a veth (peer0 in `peer`), MTU 1400, a chosen MAC, IPv4 and
    IPv6 addresses, default routes through gateways; both ends up."""
    with _namespace() as ns:
        ns.ip("link", "add", "eth0", "mtu", "1400", "address", POD_MAC, "type", "veth",
              "peer", "name", "peer0", "address", PEER_MAC, "mtu", "1400", "netns", peer.name)
        ns.ip("addr", "add", "10.9.0.2/24", "dev", "eth0")
        ns.ip("addr", "add", "fd00:9::2/64", "dev", "eth0", "nodad")
        ns.ip("link", "set", "eth0", "up")
        ns.ip("link", "set", "lo", "up")
        peer.ip("link", "set", "peer0", "up")
        ns.ip("route", "add", "default", "via", "10.9.0.1")
        ns.ip("-6", "route", "add", "default", "via", "fd00:9::1")
        yield ns
