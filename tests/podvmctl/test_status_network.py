"""podvmctl status says what network the pod has: its namespace, each interface with
its addresses and the tap that bridges it, the routes CNI made; and the vhost-net
workers among the VM's threads."""
from __future__ import annotations

from podvmctl import status


def report(network: dict) -> dict:
    return {"sandbox_id": "sb", "namespace": "k8s.io", "qemu_pid": 10, "shim_pid": 9,
            "network": network}


def test_a_bridged_interface_with_its_tap_and_routes() -> None:
    text = status.render(report({
        "netns": "/var/run/netns/cni-1", "taps": ["tap0_podvm"],
        "interfaces": [{"name": "eth0", "mac": "02:00:0a:09:00:02", "mtu": 1400,
                        "addresses": [{"address": "10.9.0.2", "prefix_len": 24}]}],
        "routes": [{"destination": "10.9.0.0/24", "device": "eth0", "gateway": None,
                    "protocol": "kernel"},
                   {"destination": "0.0.0.0/0", "device": "eth0", "gateway": "10.9.0.1",
                    "protocol": "boot"}]}))
    assert "network: namespace /var/run/netns/cni-1" in text
    assert "eth0 02:00:0a:09:00:02 MTU 1400 10.9.0.2/24, bridged by tap0_podvm" in text
    assert "route 0.0.0.0/0 via 10.9.0.1 dev eth0" in text
    assert "route 10.9.0.0/24" not in text  # the address's own route: the kernel's


def test_a_pod_without_interfaces_says_so() -> None:
    assert "network: none" in status.render(report({"netns": "", "taps": []}))


def test_vhost_workers_are_network_threads() -> None:
    assert status.thread_role(10, 12, "vhost-10", 9) == "net"
    assert status.thread_role(10, 11, "CPU 0/TCG", 9) == "vcpu"


def test_virtiofsd_threads_serve_files() -> None:
    """virtiofsd's threads all bear its name (shim/vm/virtiofsd.py), in a process of its own."""
    assert status.thread_role(20, 20, "virtiofsd", 9) == "files"
    assert status.thread_role(21, 23, "virtiofsd", 9) == "files"
    assert status.thread_role(10, 10, "qemu-system-x86", 9) == "main"
