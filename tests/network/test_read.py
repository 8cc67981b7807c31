"""Reading a pod's network from its namespace, as CNI left it."""
from __future__ import annotations

import os
import subprocess
import time

import pytest

from shim.network.errors import NamespaceGone
from shim.network.model import Address, Route
from shim.network.read import read_network
from testbed.prereqs import require_root
from tests.network.conftest import POD_MAC, Namespace


async def test_interfaces_addresses_and_routes(pod: Namespace) -> None:
    net = await read_network(pod.path)

    assert net.netns == pod.path
    assert [itf.name for itf in net.interfaces] == ["eth0"]  # not lo
    eth0 = net.interface("eth0")
    assert (eth0.mac, eth0.mtu) == (POD_MAC, 1400)
    # the IPv6 link-local address the kernel gave eth0 is not listed
    assert eth0.addresses == (Address("10.9.0.2", 24), Address("fd00:9::2", 64))
    routes = {r.destination: r for r in net.routes}
    assert routes["0.0.0.0/0"] == Route("0.0.0.0/0", "eth0", gateway="10.9.0.1")
    assert routes["0.0.0.0/0"].is_default and routes["::/0"].is_default
    assert routes["::/0"].gateway == "fd00:9::1" and routes["::/0"].device == "eth0"
    subnet = routes["10.9.0.0/24"]
    assert (subnet.gateway, subnet.scope, subnet.source, subnet.protocol) == (
        None, "link", "10.9.0.2", "kernel")
    assert routes["fd00:9::/64"].protocol == "kernel"
    assert not [d for d in routes if d.startswith("fe80") or d.startswith("ff")]


async def test_extra_route_with_source_and_metric(pod: Namespace) -> None:
    pod.ip("route", "add", "192.168.7.0/24", "via", "10.9.0.1", "src", "10.9.0.2",
           "metric", "7")
    net = await read_network(pod.path)
    assert Route("192.168.7.0/24", "eth0", gateway="10.9.0.1", source="10.9.0.2",
                 metric=7) in net.routes


async def test_namespace_of_a_process(pod: Namespace) -> None:
    """containerd may name the namespace as /proc/<pid>/ns/net."""
    proc = subprocess.Popen(["ip", "netns", "exec", pod.name, "sleep", "60"])
    try:
        path = f"/proc/{proc.pid}/ns/net"
        deadline = time.monotonic() + 10
        while os.stat(path).st_ino != os.stat(pod.path).st_ino:  # until it has entered
            assert time.monotonic() < deadline, "the process never entered the namespace"
            time.sleep(0.02)
        net = await read_network(path)
        assert net.interface("eth0").mac == POD_MAC
    finally:
        proc.kill()
        proc.wait()


async def test_a_missing_namespace_is_named(tmp_path) -> None:
    require_root()
    missing = "/var/run/netns/podvmt-never-made"
    with pytest.raises(NamespaceGone, match=missing):
        await read_network(missing)
    not_a_namespace = tmp_path / "netns"
    not_a_namespace.write_text("")
    with pytest.raises(NamespaceGone, match="not a network namespace"):
        await read_network(str(not_a_namespace))
