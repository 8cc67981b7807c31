"""Attaching a pod's interfaces to taps, and detaching: what is in the namespace after
each, checked with iproute2."""
from __future__ import annotations

import dataclasses
import fcntl
import os
import struct

import pytest

from shim.network.attach import attach
from shim.network.detach import detach
from shim.network.errors import NetworkError
from shim.network.model import Interface, PodNetwork
from shim.network.read import read_network
from shim.network.tap import IFF_NO_PI, IFF_TAP, IFF_VNET_HDR
from tests.network.conftest import POD_MAC, Namespace

TUNGETIFF = 0x800454D2


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def assert_nothing_of_podvm(pod: Namespace) -> None:
    assert set(pod.links()) == {"lo", "eth0"}
    assert [q["kind"] for q in pod.qdiscs("eth0")] == ["noqueue"]


async def test_attach_bridges_eth0_to_a_tap(pod: Namespace) -> None:
    net = await read_network(pod.path)
    (nic,) = await attach(net)
    try:
        assert (nic.index, nic.interface, nic.tap, nic.mac, nic.mtu) == (
            0, "eth0", "tap0_podvm", POD_MAC, 1400)
        assert (nic.vhost_fd is not None) == os.path.exists("/dev/vhost-net")

        tap = pod.links()["tap0_podvm"]
        assert tap["linkinfo"]["info_kind"] == "tun"
        assert (tap["mtu"], tap["operstate"] in ("UP", "UNKNOWN"), "UP" in tap["flags"]) == (
            1400, True, True)
        # the descriptor is that tap, without packet info, with virtio-net headers
        ifreq = fcntl.ioctl(nic.tap_fd, TUNGETIFF, bytes(40))
        name, flags = struct.unpack_from("16sH", ifreq)
        assert name.rstrip(b"\0") == b"tap0_podvm"
        assert flags & (IFF_TAP | IFF_NO_PI | IFF_VNET_HDR) == IFF_TAP | IFF_NO_PI | IFF_VNET_HDR

        for dev, other in (("eth0", "tap0_podvm"), ("tap0_podvm", "eth0")):
            assert "ingress" in [q["kind"] for q in pod.qdiscs(dev)]
            (u32,) = pod.ingress_filters(dev)
            assert (u32["kind"], u32["protocol"]) == ("u32", "all")
            assert u32["options"]["match"] == {"value": "0", "mask": "0", "offmask": "",
                                               "off": 0}
            (mirred,) = u32["options"]["actions"]
            assert (mirred["kind"], mirred["mirred_action"], mirred["direction"],
                    mirred["to_dev"]) == ("mirred", "redirect", "egress", other)

        # the tap is podvm's, not the pod's: reading again gives what CNI made
        assert await read_network(pod.path) == net
    finally:
        nic.close()
        await detach(pod.path)


async def test_detach_leaves_nothing_and_can_be_repeated(pod: Namespace) -> None:
    nics = await attach(await read_network(pod.path))
    await detach(pod.path)
    assert_nothing_of_podvm(pod)
    await detach(pod.path)
    for nic in nics:
        nic.close()
    assert_nothing_of_podvm(pod)
    # and the pod can be attached again
    nics = await attach(await read_network(pod.path))
    for nic in nics:
        nic.close()
    await detach(pod.path, [nic.tap for nic in nics])
    assert_nothing_of_podvm(pod)
    await detach(pod.path, ["eth0"])  # a name that is no tap of podvm's is left alone
    assert_nothing_of_podvm(pod)


async def test_detach_while_the_tap_is_held_open(pod: Namespace) -> None:
    """After a shim crash QEMU may still hold the tap: `delete` removes it by name."""
    nics = await attach(await read_network(pod.path))
    try:
        await detach(pod.path, [nic.tap for nic in nics])
        assert_nothing_of_podvm(pod)
    finally:
        for nic in nics:
            nic.close()


async def test_detach_of_a_namespace_already_gone(pod: Namespace) -> None:
    nics = await attach(await read_network(pod.path))
    try:
        pod.delete()  # containerd removed it; the taps' descriptors keep it alive
        await detach(pod.path, [nic.tap for nic in nics])
    finally:
        for nic in nics:
            nic.close()
    await detach("/var/run/netns/podvmt-never-made", ["tap0_podvm"])


async def test_attach_failing_half_way_leaves_nothing(pod: Namespace) -> None:
    """eth0 is bridged, then eth1 is not there: eth0's tap and redirects are undone."""
    net = await read_network(pod.path)
    eth1 = dataclasses.replace(net.interface("eth0"), name="eth1")
    before = open_fds()
    with pytest.raises(NetworkError) as failed:
        await attach(dataclasses.replace(net, interfaces=(*net.interfaces, eth1)))
    assert str(failed.value) == (f"network namespace {pod.path}: eth1: find the interface: "
                                 "no such interface")
    assert_nothing_of_podvm(pod)
    assert open_fds() == before


async def test_attach_failing_at_the_tap_leaves_nothing(pod: Namespace) -> None:
    """A tap takes no MTU above 65521: the error names the step; the tap goes."""
    net = PodNetwork(pod.path, (Interface("eth0", POD_MAC, 70000),))
    before = open_fds()
    with pytest.raises(NetworkError) as failed:
        await attach(net)
    message = str(failed.value)
    assert message.startswith(f"network namespace {pod.path}: eth0: set the MTU of "
                              "tap0_podvm to 70000 and bring it up: ")
    assert_nothing_of_podvm(pod)
    assert open_fds() == before


async def test_an_ingress_qdisc_of_someone_else_is_refused_and_kept(pod: Namespace) -> None:
    pod.tc("qdisc", "add", "dev", "eth0", "ingress")
    with pytest.raises(NetworkError, match="eth0: find the interface: it already has an "
                                           "ingress qdisc"):
        await attach(await read_network(pod.path))
    assert "tap0_podvm" not in pod.links()
    await detach(pod.path)  # not podvm's: left alone
    assert "ingress" in [q["kind"] for q in pod.qdiscs("eth0")]


async def test_attach_to_a_missing_namespace_is_named() -> None:
    net = PodNetwork("/var/run/netns/podvmt-never-made", (Interface("eth0", POD_MAC, 1500),))
    with pytest.raises(NetworkError, match="podvmt-never-made: open the namespace"):
        await attach(net)

