"""The agent's own rtnetlink requests (guest/agent/rtnetlink.py) against a real kernel:
guest/agent/network.py's configure() run on the host in a throwaway network namespace
that stands for the guest's (a veth with the pod's MAC stands for the virtio-net device),
checked with iproute2, another netlink implementation. The namespace and its devices are
deleted afterwards, failure or not."""
from __future__ import annotations

import json
import pathlib
import secrets
import subprocess
import sys
from typing import Iterator

import pytest

from podvm_core.pb.agent import agent_pb2 as pb
from testbed.prereqs import require_root, require_tool

ROOT = pathlib.Path(__file__).resolve().parents[2]
MAC = "02:00:0a:09:00:02"
CONFIGURE = ("import asyncio, sys\n"
             "from guest.agent import network\n"
             "from podvm_core.pb.agent import agent_pb2 as pb\n"
             "req = pb.ConfigureNetworkRequest.FromString(sys.stdin.buffer.read())\n"
             "try:\n"
             "    asyncio.run(network.configure(req))\n"
             "except Exception as exc:\n"
             "    print(getattr(exc, 'message', exc)); sys.exit(1)\n")


@pytest.fixture
def guest() -> Iterator[str]:
    """A namespace whose one Ethernet device, eth7, has the pod's MAC and is down."""
    require_root()
    require_tool("ip", "iproute2")
    name = f"podvm-nl-{secrets.token_hex(4)}"
    ip("netns", "add", name)
    try:
        ip("-n", name, "link", "add", "eth7", "address", MAC, "type", "veth", "peer", "name",
           "peer7")
        ip("-n", name, "link", "set", "peer7", "up")
        yield name
    finally:
        ip("netns", "delete", name)


def ip(*args: str) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, f"ip {' '.join(args)}: {done.stderr.strip()}"
    return done.stdout


def configure(netns: str, req: pb.ConfigureNetworkRequest) -> subprocess.CompletedProcess:
    """network.configure(req) in `netns` (`ip netns exec` mounts its /sys/class/net)."""
    return subprocess.run(["ip", "netns", "exec", netns, sys.executable, "-c", CONFIGURE],
                          input=req.SerializeToString(), capture_output=True, cwd=ROOT,
                          timeout=60)


def request(*extra_routes: pb.NetworkRoute) -> pb.ConfigureNetworkRequest:
    return pb.ConfigureNetworkRequest(
        interfaces=[pb.NetworkInterface(name="eth0", mac=MAC.upper(), mtu=1400, addresses=[
            pb.IPAddress(address="10.9.0.2", prefix_len=24),
            pb.IPAddress(address="fd00:9::2", prefix_len=64)])],
        routes=[pb.NetworkRoute(destination="0.0.0.0/0", gateway="10.9.0.1", device="eth0"),
                pb.NetworkRoute(destination="10.10.0.0/16", device="eth0", scope="link",
                                source="10.9.0.2", metric=5),
                pb.NetworkRoute(destination="::/0", gateway="fd00:9::1", device="eth0"),
                *extra_routes])


def routes(netns: str, family: str) -> list[dict]:
    return [{k: r[k] for k in ("dst", "gateway", "dev", "scope", "prefsrc", "metric")
             if k in r} for r in json.loads(ip("-n", netns, "-j", family, "route", "show"))
            if r.get("protocol") != "kernel"]


def test_the_pods_interface_is_renamed_addressed_and_routed(guest: str) -> None:
    for _ in range(2):  # a second time: every step replaces, nothing is added twice
        done = configure(guest, request())
        assert done.returncode == 0, done.stdout + done.stderr
        (link,) = [link for link in json.loads(ip("-n", guest, "-j", "addr", "show"))
                   if link["ifname"].startswith("eth")]
        assert (link["ifname"], link["address"], link["mtu"]) == ("eth0", MAC, 1400)
        assert "UP" in link["flags"]
        assert {(a["local"], a["prefixlen"]) for a in link["addr_info"]
                if a.get("scope") == "global"} == {("10.9.0.2", 24), ("fd00:9::2", 64)}
        assert sorted(routes(guest, "-4"), key=str) == sorted([
            {"dst": "default", "gateway": "10.9.0.1", "dev": "eth0"},
            {"dst": "10.10.0.0/16", "dev": "eth0", "scope": "link", "prefsrc": "10.9.0.2",
             "metric": 5}], key=str)
        assert {"dst": "default", "gateway": "fd00:9::1", "dev": "eth0",
                "metric": 1024} in routes(guest, "-6")


def test_the_kernels_refusal_names_the_step(guest: str) -> None:
    done = configure(guest, request(pb.NetworkRoute(destination="10.12.0.0/16",
                                                    gateway="10.99.0.1", device="eth0")))
    assert done.returncode == 1
    said = done.stdout.decode()
    assert "route 10.12.0.0/16 via 10.99.0.1 dev eth0" in said, said
    assert "`ip route replace 10.12.0.0/16 via 10.99.0.1 dev eth0` failed" in said, said
    assert "unreachable" in said, said
