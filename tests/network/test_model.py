"""The values: what QEMU is given for a NIC, and a pod's network through JSON."""
from __future__ import annotations

import dataclasses
import json

from shim.dataclassjson import dataclass_from_json
from shim.network.model import Address, Interface, PodNetwork, Route, TapNic


def test_qemu_arguments() -> None:
    nic = TapNic(index=1, interface="eth0", tap="tap1_podvm", mac="02:00:0a:09:00:02",
                 mtu=1400, tap_fd=7, vhost_fd=None)
    assert nic.qemu_args() == [
        "-netdev", "tap,id=net1,fd=7",
        "-device", "virtio-net-pci,netdev=net1,mac=02:00:0a:09:00:02,host_mtu=1400,romfile="]
    assert nic.fds == (7,)
    vhost = dataclasses.replace(nic, vhost_fd=8)
    assert vhost.qemu_args()[1] == "tap,id=net1,fd=7,vhost=on,vhostfd=8"
    assert vhost.fds == (7, 8)


def test_a_pod_network_through_json_as_the_pod_state_keeps_it() -> None:
    net = PodNetwork(
        netns="/var/run/netns/cni-1234",
        interfaces=(Interface("eth0", "02:00:0a:09:00:02", 1450,
                              (Address("10.9.0.2", 24), Address("fd00:9::2", 64))),),
        routes=(Route("0.0.0.0/0", "eth0", gateway="10.9.0.1"),
                Route("10.9.0.0/24", "eth0", scope="link", source="10.9.0.2",
                      protocol="kernel"),
                Route("::/0", "eth0", gateway="fd00:9::1", metric=1024)))
    text = json.dumps(dataclasses.asdict(net))
    assert dataclass_from_json(PodNetwork, json.loads(text), "test") == net
    assert [r.is_default for r in net.routes] == [True, False, True]
    assert [str(a) for a in net.interfaces[0].addresses] == ["10.9.0.2/24", "fd00:9::2/64"]
