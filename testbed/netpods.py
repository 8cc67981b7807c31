"""Pods on the POD network of a test containerd (testbed/bridgenet.py), seen as a user
sees them: through crictl only, whatever the runtime handler (and, for what a pod leaves
in its namespace, through iproute2). Every wait is bounded."""
from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import pathlib
import subprocess
import time
import urllib.error
import urllib.request
from typing import Iterator

from .containerd import Containerd
from .cri import Crictl, ExecResult

POD_NETWORK = 0  # NamespaceMode.POD: containerd makes the namespace and runs CNI in it
HTTP_PORT = 8080


def pod_network_config(ctd: Containerd, configs: pathlib.Path, name: str, **extra) -> dict:
    """A pod on the POD network, its logs and cgroups where the test can clean them up.
    snake_case and numeric enums: the real crictl reads only those. The log directory is
    made, as kubelet makes it before RunPodSandbox."""
    (configs / "logs" / name).mkdir(parents=True, exist_ok=True)
    return {
        "metadata": {"name": name, "namespace": "podvm-test", "uid": f"uid-{name}",
                     "attempt": 0},
        "hostname": name,
        "log_directory": str(configs / "logs" / name),
        "linux": {"cgroup_parent": ctd.cgroup_parent,
                  "security_context": {"namespace_options": {"network": POD_NETWORK}}},
        **extra,
    }


def httpd_script(page: str, port: int = HTTP_PORT) -> str:
    """A container command: busybox httpd serving `page` as / on `port`."""
    return (f"mkdir -p /www && echo '{page}' > /www/index.html && "
            f"exec httpd -f -p {port} -h /www")


def pod_ip(crictl: Crictl, pod_id: str) -> str:
    """The pod's IP as `crictl inspectp` reports it (status.network.ip)."""
    return crictl.inspectp(pod_id)["status"]["network"]["ip"]


def interface_addresses(crictl: Crictl, container_id: str, ifname: str = "eth0"
                        ) -> list[ipaddress.IPv4Interface]:
    """The IPv4 addresses of `ifname` as the container sees it (busybox `ip`)."""
    r = crictl.exec(container_id, "ip", "-4", "-o", "addr", "show", "dev", ifname,
                    timeout=20)
    assert r.exit_code == 0, f"ip addr show dev {ifname}: {r.exit_code}: {r.stderr}"
    words = r.stdout.split()
    return [ipaddress.IPv4Interface(words[i + 1]) for i, w in enumerate(words)
            if w == "inet"]


def routes(crictl: Crictl, container_id: str) -> list[str]:
    """The container's IPv4 routes, one `ip route` line each."""
    r = crictl.exec(container_id, "ip", "-4", "route", "show", timeout=20)
    assert r.exit_code == 0, f"ip route: {r.exit_code}: {r.stderr}"
    return [" ".join(line.split()) for line in r.stdout.splitlines() if line.strip()]


def listening_ports(crictl: Crictl, container_id: str) -> set[int]:
    """TCP ports something listens on in the container's network namespace, from
    /proc/net/tcp{,6} (no tool needed in the image)."""
    # Exit 0 even without IPv6 (no tcp6): the real crictl prints no stdout otherwise.
    r = crictl.exec(container_id, "sh", "-c", "cat /proc/net/tcp /proc/net/tcp6 2>/dev/null;"
                    " true", timeout=20)
    ports = set()
    for line in r.stdout.splitlines()[1:]:
        fields = line.split()
        if len(fields) > 3 and fields[3] == "0A" and ":" in fields[1]:  # TCP_LISTEN
            ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def wait_for_port(crictl: Crictl, container_id: str, port: int = HTTP_PORT,
                  timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while port not in listening_ports(crictl, container_id):
        if time.monotonic() > deadline:
            raise AssertionError(f"nothing listens on TCP port {port} in container "
                                 f"{container_id} after {timeout}s")
        time.sleep(0.3)


def url(ip: str, port: int = HTTP_PORT, path: str = "/") -> str:
    return f"http://{ip}:{port}{path}"


def fetch_from_pod(crictl: Crictl, container_id: str, target: str,
                   timeout: float = 15) -> str:
    """`target`'s body as busybox `wget` in the container gets it; tries again (each
    try bounded by the exec's timeout: Debian's busybox 1.35 `wget -T` segfaults) until
    `timeout`, then fails with the last answer."""
    deadline = time.monotonic() + timeout
    while True:
        r: ExecResult = crictl.exec(container_id, "wget", "-q", "-O", "-", target,
                                    timeout=10)
        if r.exit_code == 0:
            return r.stdout
        if time.monotonic() > deadline:
            raise AssertionError(f"wget {target} in container {container_id} failed for "
                                 f"{timeout}s; last: exit {r.exit_code}: {r.stderr.strip()}")
        time.sleep(0.5)


def fetch_from_host(target: str, timeout: float = 15) -> str:
    """`target`'s body as this machine gets it, straight (no proxy from the environment);
    tries again until `timeout`."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    deadline = time.monotonic() + timeout
    while True:
        try:
            with opener.open(target, timeout=5) as response:
                return response.read().decode()
        except (urllib.error.URLError, OSError) as exc:
            if time.monotonic() > deadline:
                raise AssertionError(f"the host could not fetch {target} for {timeout}s: "
                                     f"{exc}") from None
            time.sleep(0.5)


@contextlib.contextmanager
def held_netns(path: str) -> Iterator[str]:
    """A path to the network namespace at `path` that stays valid after containerd
    removes it (the open descriptor keeps the namespace alive): /proc/<pid>/fd/<n>."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        yield f"/proc/{os.getpid()}/fd/{fd}"
    finally:
        os.close(fd)


def netns_links(path: str) -> list[str]:
    """The names of the devices in the network namespace at `path` (iproute2)."""
    done = subprocess.run(["nsenter", f"--net={path}", "ip", "-j", "link", "show"],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, f"ip link in {path}: {done.stderr.strip()}"
    return [link["ifname"] for link in json.loads(done.stdout)]
