"""A Task-API pod in a network namespace as CNI leaves one (a veth `eth0` with addresses,
an MTU and routes; its peer in a second namespace standing for the node's bridge): the
VM's eth0 gets the same, the peer reaches the pod by ping and TCP, and the deleted pod
leaves neither tap nor ingress qdisc in the namespace. Both namespaces are the test's
(tests/network/conftest.py's helpers) and deleted afterwards; no traffic leaves them."""
from __future__ import annotations

import asyncio
import pathlib
import subprocess
import time
from typing import Iterator

import psutil
import pytest

from podvm_core.pb.containerd.task.v2 import shim_pb2 as api
from podvm_core.ttrpc import TtrpcError
from testbed.shimproc import daemon_pid, open_files
from testbed.taskshim import (NS, Fifos, busybox_rootfs, call, create, shim_daemon, task_shim,
                              workload_bundle)
from testbed.vmconfig import vm_config, warm
from tests.network.conftest import PEER_MAC, POD_MAC, Namespace, _namespace

PODVMCTL = pathlib.Path(__file__).resolve().parents[2] / ".venv" / "bin" / "podvmctl"

PAGE = "served from the VM"


@pytest.fixture(scope="module")
def rootfs(tmp_path_factory) -> pathlib.Path:
    return busybox_rootfs(tmp_path_factory.mktemp("busybox-rootfs"))


@pytest.fixture
def netns() -> Iterator[tuple[Namespace, Namespace]]:
    """(pod, peer): eth0 in `pod` as CNI's bridge plugin leaves it (MTU 1400, IPv4 and
    IPv6, a route through the gateway besides the default one), peer0 in `peer` with
    the gateways' addresses."""
    with _namespace() as peer, _namespace() as pod:
        pod.ip("link", "add", "eth0", "mtu", "1400", "address", POD_MAC, "type", "veth",
               "peer", "name", "peer0", "address", PEER_MAC, "mtu", "1400", "netns", peer.name)
        pod.ip("addr", "add", "10.9.0.2/24", "dev", "eth0")
        pod.ip("addr", "add", "fd00:9::2/64", "dev", "eth0", "nodad")
        pod.ip("link", "set", "eth0", "up")
        pod.ip("link", "set", "lo", "up")
        pod.ip("route", "add", "default", "via", "10.9.0.1")
        pod.ip("route", "add", "10.20.0.0/16", "via", "10.9.0.1", "metric", "7")
        pod.ip("-6", "route", "add", "default", "via", "fd00:9::1")
        peer.ip("addr", "add", "10.9.0.1/24", "dev", "peer0")
        peer.ip("addr", "add", "fd00:9::1/64", "dev", "peer0", "nodad")
        peer.ip("link", "set", "peer0", "up")
        yield pod, peer


def peer_run(peer: Namespace, *argv: str, timeout: float = 10) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", "netns", "exec", peer.name, *argv], capture_output=True,
                          text=True, timeout=timeout)


def until_ok(peer: Namespace, *argv: str, timeout: float = 30) -> str:
    """`argv` in the peer's namespace, again until it succeeds (each try bounded), for
    at most `timeout` seconds: its stdout."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            done = peer_run(peer, *argv)
            if done.returncode == 0:
                return done.stdout
            last = f"exit {done.returncode}: {done.stderr.strip()}"
        except subprocess.TimeoutExpired:
            last = "timed out"
        if time.monotonic() > deadline:
            raise AssertionError(f"{' '.join(argv)} in {peer.name} failed for {timeout}s; "
                                 f"last: {last}")
        time.sleep(0.5)


async def test_the_vm_is_the_pod_on_its_network(tmp_path, rootfs, netns) -> None:
    pod, peer = netns
    async with task_shim(tmp_path, rootfs, netns=pod.path) as shim:
        taps = [name for name in pod.links() if name.endswith("_podvm")]
        assert len(taps) == 1, pod.links()
        assert [q["kind"] for q in pod.qdiscs("eth0")].count("ingress") == 1
        fifos = Fifos(shim["tmp"], "web")
        script = ("ip -o addr show dev eth0; ip -o link show dev eth0; ip route; "
                  "ip -6 route; echo END; mkdir -p /www; "
                  f"echo '{PAGE}' > /www/index.html; exec httpd -f -p 8080 -h /www")
        await create(shim, "web", workload_bundle(shim, "web", args=["sh", "-c", script]),
                     fifos)
        await call(shim, "Start", api.StartRequest(id="web"), api.StartResponse)
        seen = (await fifos.read(fifos.out, b"END\n")).decode()
        assert "inet 10.9.0.2/24" in seen, seen
        assert "inet6 fd00:9::2/64" in seen, seen
        assert "mtu 1400" in seen and POD_MAC in seen, seen
        routes = [" ".join(line.split()) for line in seen.splitlines()]
        assert "default via 10.9.0.1 dev eth0" in routes, routes
        assert "10.20.0.0/16 via 10.9.0.1 dev eth0 metric 7" in routes, routes
        assert any(r.startswith("default via fd00:9::1 dev eth0") for r in routes), routes
        v6 = next(line for line in seen.splitlines() if "fd00:9::2/64" in line)
        assert "tentative" not in v6 and "dadfailed" not in v6, v6

        await asyncio.to_thread(until_ok, peer, "busybox", "ping", "-c", "1", "-W", "2",
                                "10.9.0.2")
        await asyncio.to_thread(until_ok, peer, "busybox", "ping", "-c", "1", "-W", "2",
                                "fd00:9::2")
        got = await asyncio.to_thread(until_ok, peer, "busybox", "wget", "-q", "-O", "-",
                                      "http://10.9.0.2:8080/")
        assert got == PAGE + "\n"

        status = subprocess.run([str(PODVMCTL), "status", "sb", "--namespace", NS],
                                capture_output=True, text=True, check=True).stdout
        assert f"network: namespace {pod.path}" in status, status
        assert f"eth0 {POD_MAC} MTU 1400 10.9.0.2/24, fd00:9::2/64, bridged by {taps[0]}" \
            in status, status
        assert "route 0.0.0.0/0 via 10.9.0.1 dev eth0" in status, status

        await call(shim, "Kill", api.KillRequest(id="web", signal=9))
        await call(shim, "Wait", api.WaitRequest(id="web"), api.WaitResponse)
        await call(shim, "Delete", api.DeleteRequest(id="web"), api.DeleteResponse)
    assert sorted(pod.links()) == ["eth0", "lo"]
    assert [q for q in pod.qdiscs("eth0") if q["kind"] == "ingress"] == []


async def test_an_attach_that_fails_while_the_template_is_copied_leaves_nothing(
        tmp_path, rootfs, netns) -> None:
    """A pod whose shape has a template copies the template's memory while its taps are
    made (shim/vm/template/restore.py, copy_ahead), and makes its sandbox cgroup in a
    thread meanwhile; an attach that fails then stops the copy (the shim's threads, in
    the sandbox cgroup, or a copier process there) once the cgroup is made, and the pod
    leaves nothing behind: no copier, no memfd, no cgroup."""
    pod, _ = netns
    q = vm_config().qemu
    await asyncio.to_thread(warm, q, f"{q.default_vcpus}:{q.default_memory}:1:1400")
    pod.ip("link", "add", "tap0_podvm", "type", "bridge")  # in the way of podvm's tap
    async with shim_daemon(tmp_path, rootfs, netns=pod.path) as shim:
        with pytest.raises(TtrpcError) as err:
            await create(shim, "sb", shim["bundle"], Fifos(tmp_path, "sb"))
        assert "tap0_podvm" in err.value.message, err.value.message
        log = (shim["bundle"] / "log").read_text()
        assert "memory copied ahead" in log, log  # the path under test was taken
        copiers = [p.pid for p in psutil.process_iter(["cmdline"])
                   if any(a.endswith("/shim/vm/memcopy.py") for a in p.info["cmdline"] or [])]
        assert copiers == []
        daemon = daemon_pid(NS, "sb")  # up: containerd has not deleted it yet
        memfds = [link for link in open_files(daemon) if "memfd:" in link]
        assert memfds == []  # the guest's RAM it filled is closed
        pod_cgroup = shim["cgroups_path"].rsplit("/", 1)[0].strip("/")
        for hierarchy in ("memory", "cpu", "cpuset"):
            left = pathlib.Path("/sys/fs/cgroup", hierarchy, pod_cgroup)
            assert not left.exists() or [d for d in left.iterdir() if d.is_dir()] == []
    pod.ip("link", "delete", "tap0_podvm")
    assert sorted(pod.links()) == ["eth0", "lo"]
    assert [q for q in pod.qdiscs("eth0") if q["kind"] == "ingress"] == []
