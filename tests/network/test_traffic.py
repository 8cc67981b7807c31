"""Frames really cross: from the veth's far end (the node's side) through eth0 to the tap's
descriptor (what QEMU reads), and back. Raw Ethernet frames of the local experimental
EtherType between the test's own namespaces; every wait is bounded."""
from __future__ import annotations

import os
import secrets
import select
import socket
import time

from pyroute2 import netns as pyroute2_netns

from shim.network.attach import attach
from shim.network.detach import detach
from shim.network.read import read_network
from tests.network.conftest import PEER_MAC, POD_MAC, Namespace

ETH_P_ALL = 0x0003
ETH_P_EXPERIMENTAL = 0x88B5
VNET_HDR = 10
"""sizeof(struct virtio_net_hdr): what IFF_VNET_HDR puts before each frame (QEMU sets
another size with TUNSETVNETHDRSZ; the test keeps the kernel's default)."""
PACKET_OUTGOING = 4


def frame(dst: str, src: str, payload: bytes) -> bytes:
    return (bytes.fromhex(dst.replace(":", "")) + bytes.fromhex(src.replace(":", ""))
            + ETH_P_EXPERIMENTAL.to_bytes(2, "big") + payload.ljust(46, b"\0"))


def receive(read, fd: int, wanted: bytes, timeout: float = 5.0) -> bytes:
    """The first frame from `read()` that carries `wanted`, skipping the rest (IPv6
    neighbour discovery...)."""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        if not select.select([fd], [], [], left)[0]:
            break
        data = read()
        if data is not None and wanted in data:
            return data
    raise AssertionError(f"no frame carrying {wanted!r} within {timeout} s")


def packet_socket(peer: Namespace) -> socket.socket:
    """An AF_PACKET socket on peer0, made in the peer's namespace."""
    sock = pyroute2_netns.create_socket(peer.path, socket.AF_PACKET, socket.SOCK_RAW,
                                        socket.htons(ETH_P_ALL), flags=0)
    sock.bind(("peer0", 0))
    return sock


async def test_frames_cross_between_the_node_and_the_tap(pod: Namespace,
                                                         peer: Namespace) -> None:
    (nic,) = await attach(await read_network(pod.path))
    sock = packet_socket(peer)
    try:
        os.set_blocking(nic.tap_fd, False)

        inbound = frame(POD_MAC, PEER_MAC, b"to the guest " + secrets.token_bytes(8))
        sock.send(inbound)
        got = receive(lambda: os.read(nic.tap_fd, 65536), nic.tap_fd, inbound[14:34])
        assert got[VNET_HDR:VNET_HDR + len(inbound)] == inbound

        outbound = frame(PEER_MAC, POD_MAC, b"from the guest " + secrets.token_bytes(8))
        os.write(nic.tap_fd, bytes(VNET_HDR) + outbound)

        def from_eth0() -> bytes | None:
            data, address = sock.recvfrom(65536)
            return None if address[2] == PACKET_OUTGOING else data

        got = receive(from_eth0, sock.fileno(), outbound[14:34])
        assert got[:len(outbound)] == outbound
    finally:
        sock.close()
        nic.close()
        await detach(pod.path)
