"""A private CNI bridge network for one test containerd, and its removal.

The pods of a test containerd get the `bridge` plugin on a bridge of its own, with
host-local IPAM on a /24 that collides with no route on this machine, and no default
route: only the subnet and one private /16 (`routed`) through the gateway, so that
gateway routes are exercised. The host holds that /16 as an unreachable route while the
network exists: nothing a pod sends there leaves the machine (and the next test
containerd, looking at the host's routes, picks another /16).

The bridge is made here, before containerd runs (the plugin adopts it), so that its
route is visible at once to any other test containerd choosing a subnet. Everything about
a network lives in the kernel: the bridge's alias names the process that owns it, its
/16, and what the machine was like before the first test network (net.ipv4.ip_forward,
which the plugin turns on for a gateway, and the directories CNI and containerd make);
the last network to go puts those back. A network whose owner died is removed by the
next one made.
"""
from __future__ import annotations

import contextlib
import glob
import hashlib
import ipaddress
import json
import os
import pathlib
import random
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from typing import Iterator

CNI_BIN_DIR = pathlib.Path("/usr/lib/cni")
CNI_CACHE_DIR = pathlib.Path("/var/lib/cni")  # libcni's cache (results/<net>-<id>-<if>)
NETNS_DIR = pathlib.Path("/run/netns")  # where containerd 1.6 pins pods' namespaces
IP_FORWARD = pathlib.Path("/proc/sys/net/ipv4/ip_forward")
BRIDGE_PREFIX = "pvt-"
ALIAS_MARK = "podvm-test"
NAME_PREFIX = "podvm-test-"
PLUGINS = ("bridge", "host-local", "loopback")
# Private /16s a test network may take: 10.112.0.0/16 to 10.243.0.0/16 (not
# Kubernetes' default service range 10.96.0.0/12, which no host route shows, nor the
# usual pod ranges from 10.244 on).
CANDIDATE_SECOND_OCTETS = range(112, 244)
LOCK_NAME = b"\0podvm-test-bridgenet"  # abstract socket: gone with its holder


@dataclass(frozen=True)
class BridgeNetwork:
    name: str  # the CNI network's name; keys libcni's cache files
    bridge: str
    subnet: ipaddress.IPv4Network  # the pods' /24
    routed: ipaddress.IPv4Network  # the /16 pods reach through the gateway
    data_dir: pathlib.Path  # host-local's allocations

    @property
    def gateway(self) -> ipaddress.IPv4Address:
        return self.subnet.network_address + 1

    def conflist(self) -> dict:
        return {
            "cniVersion": "1.0.0",
            "name": self.name,
            "plugins": [
                {"type": "loopback"},
                {"type": "bridge", "bridge": self.bridge, "isGateway": True,
                 "isDefaultGateway": False, "ipMasq": False, "hairpinMode": True,
                 "ipam": {"type": "host-local",
                          "ranges": [[{"subnet": str(self.subnet),
                                       "gateway": str(self.gateway)}]],
                          "routes": [{"dst": str(self.routed), "gw": str(self.gateway)}],
                          "dataDir": str(self.data_dir)}},
            ],
        }

    def allocated(self) -> list[str]:
        """Addresses host-local holds for pods now (one file per address)."""
        directory = self.data_dir / self.name
        if not directory.is_dir():
            return []
        return sorted(n for n in os.listdir(directory) if _is_ipv4(n))

    def ports(self) -> list[str]:
        """Interfaces on the bridge (the pods' host-side veths)."""
        return [link["ifname"] for link in _links() if link.get("master") == self.bridge]

    def cache_files(self) -> list[str]:
        return sorted(glob.glob(str(CNI_CACHE_DIR / "results" / f"{self.name}-*")))


def link_names() -> set[str]:
    """Every network interface on this machine (in this namespace)."""
    return {link["ifname"] for link in _links()}


def missing_prerequisites() -> list[str]:
    """What this machine lacks for a test network (Debian packages named)."""
    missing = [f"{CNI_BIN_DIR / p} (Debian package containernetworking-plugins)"
               for p in PLUGINS if not (CNI_BIN_DIR / p).is_file()]
    if shutil.which("ip") is None:
        missing.append("ip (Debian package iproute2)")
    return missing


def create(private_dir: pathlib.Path) -> BridgeNetwork:
    """A network for the containerd whose private directory is `private_dir`: its bridge
    up with the gateway address, the host's unreachable /16 in place. Write its
    conflist with `write_conflist`."""
    tag = hashlib.sha256(str(private_dir.resolve()).encode()).hexdigest()[:10]
    bridge, name = BRIDGE_PREFIX + tag, NAME_PREFIX + tag
    with _locked():
        _remove_orphans()
        existing = _ours()
        if any(link["ifname"] == bridge for link in existing):
            raise RuntimeError(f"bridge {bridge} already exists for {private_dir}")
        before = (_parse_alias(existing[0]["ifalias"]) if existing
                  else {"ip_forward": IP_FORWARD.read_text().strip(),
                        "var_lib_cni": _presence(CNI_CACHE_DIR),
                        "run_netns": _presence(NETNS_DIR)})
        routed, subnet = _free_subnet()
        alias = " ".join([ALIAS_MARK, f"pid={os.getpid()}", f"routed={routed}",
                          *(f"{k}={before[k]}" for k in ("ip_forward", "var_lib_cni",
                                                          "run_netns"))])
        _ip("link", "add", "name", bridge, "type", "bridge")
        try:
            _ip("link", "set", "dev", bridge, "alias", alias)
            _ip("addr", "add", f"{subnet.network_address + 1}/{subnet.prefixlen}",
                "dev", bridge)
            _ip("link", "set", "dev", bridge, "up")
            _ip("route", "add", "unreachable", str(routed))
        except BaseException:
            _remove(bridge, name, routed)
            raise
    return BridgeNetwork(name=name, bridge=bridge, subnet=subnet, routed=routed,
                         data_dir=private_dir / "ipam")


def write_conflist(network: BridgeNetwork, conf_dir: pathlib.Path) -> pathlib.Path:
    conf_dir.mkdir(parents=True, exist_ok=True)
    path = conf_dir / "10-podvm-test.conflist"
    path.write_text(json.dumps(network.conflist(), indent=2) + "\n")
    return path


def remove(network: BridgeNetwork) -> list[str]:
    """Remove the network: its bridge, any port still on it, its /16 and libcni's cache
    files for it; the last test network also puts back what came before the first.
    Returns what a clean stop would not have left (ports, cache files) and was removed."""
    with _locked():
        forced = [f"veth {p} still on {network.bridge}" for p in network.ports()]
        forced += [f"CNI cache {f}" for f in network.cache_files()]
        _remove(network.bridge, network.name, network.routed)
        return forced


# ---- the pieces -----------------------------------------------------------------------

def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")
    return result


def _links() -> list[dict]:
    return json.loads(_ip("-j", "link", "show").stdout or "[]")


def _ours() -> list[dict]:
    """Test networks' bridges on this machine, whoever owns them."""
    return [link for link in _links() if link["ifname"].startswith(BRIDGE_PREFIX)
            and link.get("ifalias", "").startswith(ALIAS_MARK + " ")]


def _parse_alias(alias: str) -> dict[str, str]:
    return dict(word.split("=", 1) for word in alias.split()[1:] if "=" in word)


def _presence(path: pathlib.Path) -> str:
    return "present" if path.exists() else "absent"


def _is_ipv4(text: str) -> bool:
    try:
        ipaddress.IPv4Address(text)
    except ValueError:
        return False
    return True


def _host_prefixes() -> list[ipaddress.IPv4Network]:
    """Every IPv4 prefix this machine routes or owns, in any table, but the default."""
    routes = json.loads(_ip("-j", "-4", "route", "show", "table", "all").stdout or "[]")
    found = []
    for route in routes:
        dst = route.get("dst", "")
        if dst in ("default", ""):
            continue
        try:
            found.append(ipaddress.IPv4Network(dst if "/" in dst else f"{dst}/32",
                                               strict=False))
        except ValueError:
            continue
    return found


def _free_subnet() -> tuple[ipaddress.IPv4Network, ipaddress.IPv4Network]:
    """A /16 that overlaps nothing the host routes, and a /24 in it."""
    taken = _host_prefixes()
    candidates = [ipaddress.IPv4Network(f"10.{n}.0.0/16") for n in CANDIDATE_SECOND_OCTETS]
    free = [c for c in candidates if not any(c.overlaps(t) for t in taken)]
    if not free:
        raise RuntimeError("no free 10.x.0.0/16 for a test network: the host routes "
                           f"{', '.join(map(str, taken))}")
    routed = random.choice(free)
    third = random.randrange(1, 255)
    return routed, ipaddress.IPv4Network(f"{routed.network_address + third * 256}/24")


def _remove(bridge: str, name: str, routed: ipaddress.IPv4Network | str) -> None:
    for link in _links():
        if link.get("master") == bridge:
            _ip("link", "del", "dev", link["ifname"], check=False)
    alias = next((link.get("ifalias", "") for link in _links() if link["ifname"] == bridge),
                 "")
    _ip("link", "del", "dev", bridge, check=False)
    _ip("route", "del", "unreachable", str(routed), check=False)
    for path in glob.glob(str(CNI_CACHE_DIR / "results" / f"{name}-*")):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    if alias and not _ours():
        _restore(_parse_alias(alias))


def _restore(before: dict[str, str]) -> None:
    """The machine as it was before the first test network: ip_forward, and the
    directories CNI and containerd made (only when empty)."""
    if before.get("ip_forward") in ("0", "1"):
        IP_FORWARD.write_text(before["ip_forward"] + "\n")
    if before.get("var_lib_cni") == "absent":
        for directory in (CNI_CACHE_DIR / "results", CNI_CACHE_DIR):
            with contextlib.suppress(OSError):
                directory.rmdir()
    if before.get("run_netns") == "absent":
        with contextlib.suppress(OSError):
            NETNS_DIR.rmdir()


def _remove_orphans() -> None:
    """Test networks whose owning process is gone (a killed test run)."""
    for link in _ours():
        fields = _parse_alias(link["ifalias"])
        pid = fields.get("pid", "")
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            tag = link["ifname"][len(BRIDGE_PREFIX):]
            _remove(link["ifname"], NAME_PREFIX + tag, fields.get("routed", ""))


@contextlib.contextmanager
def _locked(timeout: float = 60) -> Iterator[None]:
    """One test network changes at a time on this machine (choosing a subnet, restoring
    what the last one leaves): an abstract unix socket, held by binding it."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                sock.bind(LOCK_NAME)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"another test network held the lock for {timeout}s")
                time.sleep(0.05)
        yield
    finally:
        sock.close()
