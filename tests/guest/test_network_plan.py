"""What the guest agent does to its interfaces for a pod's network: which changes (each
written as the `ip` command that makes it), in which order, for a request
(guest/agent/network.py's pure part), and what a bad request or a missing device
answers. The changes themselves are made against a real kernel in
test_network_netlink.py and a real guest in tests/e2e (test_network.py,
test_task_network.py)."""
from __future__ import annotations

import pytest

from guest.agent import network
from podvm_core.pb.agent import agent_pb2 as pb
from podvm_core.ttrpc import Code, TtrpcError
from shim.vm.agent import network_request
from shim.network.model import Address, Interface, PodNetwork, Route

MAC = "02:00:0a:09:00:02"
MAC2 = "02:00:0a:09:00:03"


def itf(name: str = "eth0", mac: str = MAC, mtu: int = 1400, *addresses: tuple[str, int]
        ) -> pb.NetworkInterface:
    return pb.NetworkInterface(name=name, mac=mac, mtu=mtu, addresses=[
        pb.IPAddress(address=a, prefix_len=p) for a, p in addresses])


def commands(req: pb.ConfigureNetworkRequest, links: dict[str, str]) -> list[str]:
    return [str(step) for step in network.plan(req, links)]


def test_cni_eth0_on_the_guests_eth0_is_configured_without_a_rename() -> None:
    req = pb.ConfigureNetworkRequest(
        interfaces=[itf("eth0", MAC, 1400, ("10.9.0.2", 24))],
        routes=[pb.NetworkRoute(destination="0.0.0.0/0", gateway="10.9.0.1", device="eth0"),
                pb.NetworkRoute(destination="10.10.0.0/16", device="eth0", scope="link",
                                source="10.9.0.2", metric=5)])
    assert commands(req, {"eth0": MAC}) == [
        "ip link set dev eth0 mtu 1400 up",
        "ip addr replace 10.9.0.2/24 dev eth0",
        # on the link first: a gateway may need it
        "ip route replace 10.10.0.0/16 dev eth0 scope link src 10.9.0.2 metric 5",
        "ip route replace 0.0.0.0/0 via 10.9.0.1 dev eth0",
    ]


def test_a_guest_device_gets_the_pod_interfaces_name_down_then_up() -> None:
    req = pb.ConfigureNetworkRequest(interfaces=[itf("net1", MAC.upper(), 9000)])
    assert commands(req, {"eth0": MAC}) == [
        "ip link set dev eth0 down",
        "ip link set dev eth0 name net1",
        "ip link set dev net1 mtu 9000 up",
    ]


def test_devices_that_swap_names_go_through_names_of_their_own() -> None:
    req = pb.ConfigureNetworkRequest(interfaces=[itf("eth0", MAC2, 0), itf("eth1", MAC, 0)])
    assert commands(req, {"eth0": MAC, "eth1": MAC2}) == [
        "ip link set dev eth1 down",
        "ip link set dev eth1 name podvm-rename0",
        "ip link set dev eth0 down",
        "ip link set dev eth0 name podvm-rename1",
        "ip link set dev podvm-rename0 name eth0",
        "ip link set dev podvm-rename1 name eth1",
        "ip link set dev eth0 up",
        "ip link set dev eth1 up",
    ]


def test_ipv6_addresses_skip_duplicate_address_detection() -> None:
    req = pb.ConfigureNetworkRequest(
        interfaces=[itf("eth0", MAC, 1500, ("fd00:9::2", 64), ("10.9.0.2", 24))],
        routes=[pb.NetworkRoute(destination="::/0", gateway="fd00:9::1", device="eth0",
                                metric=1024, scope="universe")])
    assert commands(req, {"eth0": MAC}) == [
        "net/ipv6/conf/eth0/accept_dad = 0",  # before the link is up: busybox has no nodad
        "ip link set dev eth0 mtu 1500 up",
        "ip addr replace fd00:9::2/64 dev eth0",
        "ip addr replace 10.9.0.2/24 dev eth0",
        "ip -6 route replace ::/0 via fd00:9::1 dev eth0 metric 1024",
    ]


def test_a_second_call_plans_the_same_commands_on_the_renamed_device() -> None:
    """Idempotent: every step is a `replace` or a `set`; a device already renamed is
    not renamed again."""
    req = pb.ConfigureNetworkRequest(interfaces=[itf("net1", MAC, 1400, ("10.9.0.2", 24))])
    first = commands(req, {"eth0": MAC})
    again = commands(req, {"net1": MAC})
    assert first[2:] == again


def test_the_shim_sends_the_pods_network_without_the_kernels_routes() -> None:
    pod = PodNetwork(netns="/var/run/netns/x", interfaces=(
        Interface("eth0", MAC, 1400, (Address("10.9.0.2", 24), Address("fd00:9::2", 64))),),
        routes=(Route("10.9.0.0/24", "eth0", scope="link", source="10.9.0.2",
                      protocol="kernel"),
                Route("fd00:9::/64", "eth0", metric=256, protocol="kernel"),
                Route("0.0.0.0/0", "eth0", gateway="10.9.0.1"),
                Route("10.20.0.0/16", "eth0", gateway="10.9.0.1", metric=7,
                      protocol="static")))
    req = network_request(pod)
    assert commands(req, {"eth0": MAC}) == [
        "net/ipv6/conf/eth0/accept_dad = 0",
        "ip link set dev eth0 mtu 1400 up",
        "ip addr replace 10.9.0.2/24 dev eth0",
        "ip addr replace fd00:9::2/64 dev eth0",
        "ip route replace 0.0.0.0/0 via 10.9.0.1 dev eth0",
        "ip route replace 10.20.0.0/16 via 10.9.0.1 dev eth0 metric 7",
    ]


@pytest.mark.parametrize("req, words", [
    (pb.ConfigureNetworkRequest(interfaces=[itf("eth0", "02:00:0a:09:00")]), "MAC"),
    (pb.ConfigureNetworkRequest(interfaces=[itf("a/b")]), "'a/b'"),
    (pb.ConfigureNetworkRequest(interfaces=[itf("averyveryverylongname")]), "interface name"),
    (pb.ConfigureNetworkRequest(interfaces=[itf(), itf(mac=MAC2)]), "eth0 is given twice"),
    (pb.ConfigureNetworkRequest(interfaces=[itf("eth0", MAC, 1400, ("10.9.0.300", 24))]),
     "'10.9.0.300' is not an IP address"),
    (pb.ConfigureNetworkRequest(interfaces=[itf("eth0", MAC, 1400, ("10.9.0.3", 33))]),
     "prefix length"),
    (pb.ConfigureNetworkRequest(interfaces=[itf("eth0", MAC, 20)]), "MTU 20"),
    (pb.ConfigureNetworkRequest(interfaces=[itf()], routes=[
        pb.NetworkRoute(destination="10.1.0.0/16", device="eth9")]), "device 'eth9'"),
    (pb.ConfigureNetworkRequest(interfaces=[itf()], routes=[
        pb.NetworkRoute(destination="10.1.0.0", device="eth0")]), "no /prefix"),
    (pb.ConfigureNetworkRequest(interfaces=[itf()], routes=[
        pb.NetworkRoute(destination="::/0", gateway="10.9.0.1", device="eth0")]),
     "gateway '10.9.0.1' is not an IPv6 address"),
    (pb.ConfigureNetworkRequest(interfaces=[itf()], routes=[
        pb.NetworkRoute(destination="10.1.0.0/16", device="eth0", scope="galaxy")]),
     "scope 'galaxy'"),
])
def test_a_malformed_request_is_refused_before_anything_changes(req, words) -> None:
    with pytest.raises(TtrpcError) as err:
        network.plan(req, {"eth0": MAC, "eth1": MAC2})
    assert err.value.code == Code.INVALID_ARGUMENT
    assert words in err.value.message


def test_a_device_the_guest_lacks_is_named_with_what_it_has() -> None:
    req = pb.ConfigureNetworkRequest(interfaces=[itf("eth0", MAC2)])
    with pytest.raises(TtrpcError) as err:
        network.plan(req, {"eth0": MAC})
    assert err.value.code == Code.FAILED_PRECONDITION
    assert MAC2 in err.value.message and f"eth0 {MAC}" in err.value.message
    assert "virtio_net" in err.value.message


def test_a_name_held_by_a_device_that_is_not_the_pods_is_refused() -> None:
    req = pb.ConfigureNetworkRequest(interfaces=[itf("eth1", MAC)])
    with pytest.raises(TtrpcError) as err:
        network.plan(req, {"eth0": MAC, "eth1": MAC2})
    assert err.value.code == Code.FAILED_PRECONDITION and "holds that name" in err.value.message
