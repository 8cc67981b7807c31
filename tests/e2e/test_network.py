"""Pods on a CNI bridge network through the CRI, as a user of crictl sees them: a pod
serves HTTP to another pod and to the host, `inspectp` reports the address the pod's eth0
has, and removed pods leave nothing on the bridge, in host-local or in CNI's cache.

The test containerd's network (testbed/bridgenet.py): bridge + host-local on a private
/24, no default route, no masquerade; all traffic stays between its bridge and the pods.
Every test runs per runtime handler: runc proves the harness, podvm is the VM pod whose
guest eth0 is the pod's; and a runc pod and a podvm pod reach each other both ways.
Every test runs with the real crictl too: CRICTL=/path/to/crictl.
"""
from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import pathlib
import shutil
import subprocess
import time
import tomllib

import pytest

from testbed import bridgenet
from testbed.containerd import Containerd, shims_of
from testbed.cri import Crictl, write_config
from testbed.netpods import (fetch_from_host, fetch_from_pod, held_netns, httpd_script,
                             interface_addresses, netns_links, pod_ip, pod_network_config, routes,
                             url, wait_for_port)
from testbed.pods import container_config
from testbed.prereqs import require, require_root, require_tool
from testbed.vmconfig import GUEST, guest_image, write_test_config

RUNTIMES = ["runc", "podvm"]
PAGE = "hello from pod A over the bridge"


@pytest.fixture(scope="module")
def ctd(tmp_path_factory, image_cache):
    require_root()
    for tool in ("containerd", "ctr", "containerd-shim-runc-v2"):
        require_tool(tool, "containerd")
    require_tool("runc", "runc")
    require_tool("busybox", "busybox-static")
    missing = bridgenet.missing_prerequisites()
    require(not missing, ", ".join(missing))
    workdir = tmp_path_factory.mktemp("net")
    # podvm's pods need the guest image; runc's tests run without it.
    has_guest = shutil.which("qemu-system-x86_64") and (GUEST / "vmlinux").is_file() \
        and (GUEST / "initrd.img").is_file()
    podvm_config = write_test_config(workdir / "podvm.toml") if has_guest else None
    c = Containerd(workdir / "containerd", namespace="podvm-net-test", cri=True,
                   podvm_config=podvm_config)
    c.start()
    try:
        assert c.network is not None
        c.import_cri_images(image_cache)
        yield c
    finally:
        network = c.network
        c.stop()
    assert c.forced == [], f"stop() had to force: {c.forced}"
    assert shims_of(c.address) == []
    assert network is not None
    assert network.bridge not in bridgenet.link_names()
    assert network.cache_files() == []
    assert not c.cni_dir.exists()


@pytest.fixture(scope="module")
def crictl(ctd) -> Crictl:
    return Crictl(ctd.cri_endpoint, timeout="120s")


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> pathlib.Path:
    return tmp_path_factory.mktemp("net-configs")


@pytest.fixture(scope="module", params=RUNTIMES)
def runtime(request) -> str:
    if request.param == "podvm":
        guest_image()
    return request.param


class Pods:
    """Pods one test (or fixture) runs; `remove` stops and removes every one."""

    def __init__(self, crictl: Crictl, ctd: Containerd, configs: pathlib.Path,
                 runtime: str) -> None:
        self.crictl, self.ctd, self.configs, self.runtime = crictl, ctd, configs, runtime
        self.ids: list[str] = []

    def run(self, name: str, script: str) -> tuple[str, str]:
        """A pod named `name` on the POD network with one container running `script`:
        (pod id, container id)."""
        name = f"{name}-{self.runtime}"
        pod_file = write_config(self.configs, f"pod-{name}.json",
                                pod_network_config(self.ctd, self.configs, name))
        pod_id = self.crictl.runp(pod_file, runtime=self.runtime)
        self.ids.append(pod_id)
        cfile = write_config(self.configs, f"{name}-c.json", container_config(name, script))
        cid = self.crictl.create(pod_id, cfile, pod_file)
        self.crictl.start(cid)
        return pod_id, cid

    def remove(self, pod_id: str) -> None:
        self.crictl.run("stopp", pod_id)
        self.crictl.run("rmp", pod_id)
        self.ids.remove(pod_id)

    def remove_all(self) -> None:
        for pod_id in list(self.ids):
            self.crictl.run("stopp", pod_id, check=False)
            self.crictl.run("rmp", pod_id, check=False)
        self.ids.clear()


@pytest.fixture(scope="module")
def served(ctd, crictl, configs, runtime):
    """Pod A serving PAGE over HTTP, pod B idle, both on the bridge."""
    pods = Pods(crictl, ctd, configs, runtime)
    try:
        a_pod, a = pods.run("a", httpd_script(PAGE))
        b_pod, b = pods.run("b", "sleep 1000")
        wait_for_port(crictl, a)
        yield {"a_pod": a_pod, "a": a, "b_pod": b_pod, "b": b}
    finally:
        pods.remove_all()


def test_inspectp_reports_the_address_of_the_pods_eth0(ctd, crictl, served) -> None:
    ip = ipaddress.IPv4Address(pod_ip(crictl, served["a_pod"]))
    assert ip in ctd.network.subnet and ip != ctd.network.gateway
    assert [str(i.ip) for i in interface_addresses(crictl, served["a"])] == [str(ip)]
    assert pod_ip(crictl, served["b_pod"]) != str(ip)


def test_pod_routes_stay_on_the_bridge(ctd, crictl, served) -> None:
    """Only the subnet and the private /16 through the gateway: no default route."""
    table = routes(crictl, served["a"])
    assert not [r for r in table if r.startswith("default")], table
    assert any(r.startswith(f"{ctd.network.subnet} dev eth0") for r in table), table
    assert f"{ctd.network.routed} via {ctd.network.gateway} dev eth0" in table, table


def test_pod_fetches_a_page_from_another_pod(crictl, served) -> None:
    target = url(pod_ip(crictl, served["a_pod"]))
    assert fetch_from_pod(crictl, served["b"], target) == PAGE + "\n"


def test_host_fetches_a_page_from_a_pod(crictl, served) -> None:
    assert fetch_from_host(url(pod_ip(crictl, served["a_pod"]))) == PAGE + "\n"


def test_removed_pod_leaves_no_network_behind(ctd, crictl, configs, runtime) -> None:
    """Nor anything in the pod's namespace (a podvm tap): it is looked at through a
    descriptor that keeps it alive after containerd removes it."""
    network = ctd.network
    ports_before = set(network.ports())
    pods = Pods(crictl, ctd, configs, runtime)
    with contextlib.ExitStack() as stack:
        try:
            pod_id, cid = pods.run("gone", httpd_script(PAGE))
            ip = pod_ip(crictl, pod_id)
            netns = crictl.inspectp(pod_id)["info"]["runtimeSpec"]["linux"]["namespaces"]
            netns_path = next(n["path"] for n in netns if n["type"] == "network")
            held = stack.enter_context(held_netns(netns_path))
            wait_for_port(crictl, cid)
            assert fetch_from_host(url(ip)) == PAGE + "\n"  # it was on the network
            veths = set(network.ports()) - ports_before
            assert len(veths) == 1, f"the pod's veth on {network.bridge}: {veths}"
            assert ip in network.allocated()
            assert os.path.exists(netns_path)
            expected = ["eth0", "lo"] + (["tap0_podvm"] if runtime == "podvm" else [])
            assert sorted(netns_links(held)) == expected
            pods.remove(pod_id)
        finally:
            pods.remove_all()
        assert netns_links(held) == ["lo"]  # eth0 went with CNI, the tap with the VM
    assert not veths & bridgenet.link_names()
    assert ip not in network.allocated(), "host-local still holds the pod's address"
    assert not os.path.exists(netns_path)
    assert [f for f in network.cache_files() if pod_id in f] == []


def test_a_killed_shim_leaves_no_tap_once_containerd_cleans_up(ctd, crictl, configs) -> None:
    """kill -9 of a podvm pod's shim: containerd runs `shim delete`, which removes QEMU
    and, from sandbox.json, podvm's tap and redirects in the pod's namespace (CNI's eth0
    stays: it is containerd's until the pod is removed)."""
    guest_image()
    pods = Pods(crictl, ctd, configs, "podvm")
    with contextlib.ExitStack() as stack:
        try:
            pod_id, cid = pods.run("crash", "sleep 1000")
            netns = crictl.inspectp(pod_id)["info"]["runtimeSpec"]["linux"]["namespaces"]
            held = stack.enter_context(held_netns(
                next(n["path"] for n in netns if n["type"] == "network")))
            assert sorted(netns_links(held)) == ["eth0", "lo", "tap0_podvm"]
            [shim] = [pid for pid, cmd in shims_of(ctd.address) if pod_id in cmd]
            os.kill(shim, 9)

            def left() -> tuple[list[str], str]:
                """The links, and eth0's qdiscs: the tap goes with QEMU, which `shim
                delete` kills first; the redirect only with its detach, after."""
                qdiscs = subprocess.run(["nsenter", f"--net={held}", "tc", "qdisc", "show",
                                         "dev", "eth0"], capture_output=True, text=True,
                                        check=True).stdout
                return sorted(netns_links(held)), qdiscs

            deadline = time.monotonic() + 90
            while (now := left())[0] != ["eth0", "lo"] or "ingress" in now[1]:
                assert time.monotonic() < deadline, f"left in the pod's namespace: {now}"
                time.sleep(0.5)
        finally:
            pods.remove_all()
        assert netns_links(held) == ["lo"]


def test_runc_and_podvm_pods_reach_each_other(ctd, crictl, configs) -> None:
    """Both ways, on the same bridge: a VM pod is a pod like any other."""
    guest_image()
    runc, podvm = Pods(crictl, ctd, configs, "runc"), Pods(crictl, ctd, configs, "podvm")
    try:
        r_pod, r = runc.run("mixed", httpd_script("from runc"))
        v_pod, v = podvm.run("mixed", httpd_script("from podvm"))
        wait_for_port(crictl, r)
        wait_for_port(crictl, v)
        assert fetch_from_pod(crictl, v, url(pod_ip(crictl, r_pod))) == "from runc\n"
        assert fetch_from_pod(crictl, r, url(pod_ip(crictl, v_pod))) == "from podvm\n"
    finally:
        runc.remove_all()
        podvm.remove_all()


def test_exec_timeout_ends_a_command_that_hangs(ctd, crictl, configs) -> None:
    """What bounds every fetch from a pod: `exec --timeout` ends the command (the
    harness's own check, on runc only)."""
    pods = Pods(crictl, ctd, configs, "runc")
    try:
        _, cid = pods.run("hang", "sleep 1000")
        started = time.monotonic()
        r = crictl.exec(cid, "sleep", "600", timeout=2)
        elapsed = time.monotonic() - started
    finally:
        pods.remove_all()
    assert r.exit_code != 0 and "timeout" in r.raw.stderr, r
    assert elapsed < 30, f"exec --timeout 2 took {elapsed:.1f}s"


def test_containerd_uses_only_its_private_network(ctd) -> None:
    """The harness's configuration: our conflist alone, the bridge plugin on a bridge of
    this containerd's, no masquerade, no default route; the host keeps the pods' /16 to
    itself."""
    cni = tomllib.loads(ctd.config.read_text())["plugins"]["io.containerd.grpc.v1.cri"]["cni"]
    assert cni["bin_dir"] == str(bridgenet.CNI_BIN_DIR)
    conflists = list(pathlib.Path(cni["conf_dir"]).iterdir())
    assert [p.name for p in conflists] == ["10-podvm-test.conflist"]
    conf = json.loads(conflists[0].read_text())
    assert [p["type"] for p in conf["plugins"]] == ["loopback", "bridge"]
    bridge = conf["plugins"][1]
    assert bridge["bridge"] == ctd.network.bridge and len(bridge["bridge"]) <= 15
    assert (bridge["isGateway"], bridge["ipMasq"], bridge["hairpinMode"]) == (True, False, True)
    assert not bridge.get("isDefaultGateway")
    ipam = bridge["ipam"]
    assert ipam["type"] == "host-local"
    assert pathlib.Path(ipam["dataDir"]).is_relative_to(ctd.workdir)
    assert [r["dst"] for r in ipam["routes"]] == [str(ctd.network.routed)]
    host = subprocess.run(["ip", "-4", "route", "show", str(ctd.network.routed)],
                          capture_output=True, text=True, check=True).stdout
    assert host.split()[:2] == ["unreachable", str(ctd.network.routed)], host
