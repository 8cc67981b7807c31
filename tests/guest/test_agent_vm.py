"""The agent's pod network and pod namespaces in a real guest (TCG, the real image): a VM
with a NIC on a tap bridged to a namespace's eth0 (shim/network, as Machine.boot makes
it), ConfigureNetwork applied twice with the same result, its refusals in the guest's
words, and CreatePodNamespaces naming the pod's uts namespace."""
from __future__ import annotations

import dataclasses
import json
import pathlib
import time
from typing import Iterator

import pytest

from podvm_core.protocol import SANDBOX_NS
from podvm_core.ttrpc import Code, TtrpcError
from shim.vm.agent import Agent
from shim.vm.guestspec import GUEST_SHARED
from shim.vm.hypervisor import VMSpec
from shim.vm.qemu.driver import QemuVM
from shim.network.attach import attach
from shim.network.detach import detach
from shim.network.model import PodNetwork, Route
from shim.network.read import read_network
from shim.vm.stdio import Stdio
from testbed.prereqs import require_root
from testbed.taskshim import busybox_rootfs, spec
from testbed.vmconfig import vm_config
from tests.network.conftest import PEER_MAC, POD_MAC, Namespace, _namespace


@pytest.fixture
def pod() -> Iterator[Namespace]:
    """eth0 as CNI leaves it (MTU 1400, IPv4 and IPv6, routes through a gateway)."""
    with _namespace() as peer, _namespace() as ns:
        ns.ip("link", "add", "eth0", "mtu", "1400", "address", POD_MAC, "type", "veth",
              "peer", "name", "peer0", "address", PEER_MAC, "mtu", "1400", "netns", peer.name)
        ns.ip("addr", "add", "10.9.0.2/24", "dev", "eth0")
        ns.ip("addr", "add", "fd00:9::2/64", "dev", "eth0", "nodad")
        ns.ip("link", "set", "eth0", "up")
        ns.ip("route", "add", "default", "via", "10.9.0.1")
        ns.ip("route", "add", "10.20.0.0/16", "via", "10.9.0.1", "metric", "7")
        ns.ip("-6", "route", "add", "default", "via", "fd00:9::1")
        yield ns


@pytest.fixture
async def guest(tmp_path, pod):
    """(agent, the pod's network, the shared directory): a VM with the pod's NIC."""
    require_root()
    shared = tmp_path / "shared"
    shared.mkdir()
    network = await read_network(pod.path)
    nics = await attach(network)
    vm = QemuVM(VMSpec(sandbox_id="agent-net-test", workdir=str(tmp_path / "vm"),
                       shared_dir=str(shared), vcpus=1, max_vcpus=1, memory_mib=256,
                       max_memory_mib=256, hypervisor=vm_config().qemu,
                       config_source="(tests)", nics=nics))
    try:
        try:
            await vm.launch()
        finally:
            for nic in nics:
                nic.close()
        agent = Agent.of_vm(vm)
        await agent.ping(timeout=60)
        yield agent, network, shared
        await agent.close()
    finally:
        await vm.stop()
        await detach(pod.path)


async def run_in_pod(agent: Agent, shared: pathlib.Path, cid: str, script: str) -> str:
    """`script` in a container that joins the pod's namespaces: its stdout."""
    busybox_rootfs(shared / cid / "rootfs")
    s = spec(["sh", "-c", script])
    s["root"] = {"path": f"{GUEST_SHARED}/{cid}/rootfs"}
    s["linux"]["namespaces"] = [{"type": t, "path": SANDBOX_NS} for t in ("pid", "ipc", "uts")] \
        + [{"type": "mount"}, {"type": "network"}]
    s.pop("hostname")
    await agent.create_container(cid, json.dumps(s).encode(), Stdio(False, True, False, False),
                                 sandbox=False)
    await agent.start_container(cid)
    out = b""
    while chunk := await agent.read("stdout", cid, ""):
        out += chunk
    waited = await agent.wait(cid, "")
    assert waited.exit_status == 0, out
    await agent.remove(cid)
    return out.decode()


async def test_the_guest_takes_the_pods_network_twice_alike(guest) -> None:
    agent, network, shared = guest
    timings = []
    for _ in range(2):
        started = time.monotonic()
        await agent.configure_network(network)
        timings.append(time.monotonic() - started)
    print(f"ConfigureNetwork under TCG: {timings[0]:.3f}s, again {timings[1]:.3f}s")
    assert await agent.create_pod_namespaces("api-pod") > 0
    seen = await run_in_pod(agent, shared, "show", "hostname; echo --; ip -o link; echo --; "
                            "ip -o addr show dev eth0; echo --; ip route; ip -6 route")
    hostname, links, addresses, routes = [
        [" ".join(line.split()) for line in part.strip().splitlines()]
        for part in seen.split("--\n")]
    assert hostname == ["api-pod"]
    assert [line.split()[1] for line in links] == ["lo:", "eth0:"], links
    assert "<BROADCAST,MULTICAST,UP,LOWER_UP> mtu 1400" in links[1], links
    assert f"link/ether {POD_MAC}" in links[1], links
    assert sorted(line.split()[3] for line in addresses if "scope global" in line) == \
        ["10.9.0.2/24", "fd00:9::2/64"], addresses
    assert "default via 10.9.0.1 dev eth0" in routes, routes
    assert "10.20.0.0/16 via 10.9.0.1 dev eth0 metric 7" in routes, routes
    assert [r for r in routes if r.startswith("10.9.0.0/24")] == \
        ["10.9.0.0/24 dev eth0 scope link src 10.9.0.2"], routes  # once: the kernel's own
    assert "default via fd00:9::1 dev eth0 metric 1024" in routes, routes


async def test_what_the_guest_cannot_do_is_refused_in_its_words(guest) -> None:
    agent, network, _ = guest
    other_mac = dataclasses.replace(network.interfaces[0], mac="02:00:00:00:00:99")
    with pytest.raises(TtrpcError) as err:
        await agent.configure_network(dataclasses.replace(network, interfaces=(other_mac,),
                                                          routes=()))
    assert err.value.code == Code.FAILED_PRECONDITION
    assert "02:00:00:00:00:99" in err.value.message and f"eth0 {POD_MAC}" in err.value.message
    unreachable = Route("10.30.0.0/16", "eth0", gateway="10.99.0.1")
    with pytest.raises(TtrpcError) as err:
        await agent.configure_network(PodNetwork(network.netns, network.interfaces,
                                                 (unreachable,)))
    assert err.value.code == Code.FAILED_PRECONDITION
    assert "route 10.30.0.0/16 via 10.99.0.1 dev eth0" in err.value.message
    assert "Network is unreachable" in err.value.message, err.value.message
