"""The guest kernel loads what a privileged container asks for, as a node's kernel does:
the modules sit in the root image and the kernel's own requests (a bridge made, an
overlay mounted, /dev/net/tun opened, a netfilter socket) reach busybox modprobe; every
shipped module loads with what it depends on."""
from __future__ import annotations

import json

import pytest

from testbed.vmconfig import GUEST
from tests.guestprobe import run_probe

SCRIPT = r"""
export PATH=/usr/sbin:/usr/bin:/sbin:/bin
try() { name=$1; shift; if out=$("$@" 2>&1); then echo "AUTO $name ok"; else echo "AUTO $name $out"; fi; }
mkdir -p /tmp/l /tmp/u /tmp/w /tmp/m
try bridge brctl addbr br-probe
try dummy ip link add d-probe type dummy
try veth ip link add v-probe type veth peer name v-peer
try vlan ip link add link d-probe name d-probe.7 type vlan id 7
try overlay mount -t overlay overlay -o lowerdir=/tmp/l,upperdir=/tmp/u,workdir=/tmp/w /tmp/m
try tun sh -c 'mknod /tmp/tun c 10 200 && exec 3<>/tmp/tun'
try fuse sh -c 'mknod /tmp/fuse c 10 229 && exec 3<>/tmp/fuse'
try nfnetlink python3 -S -c 'import socket; socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 12)'
for m in $(cut -d: -f1 /lib/modules/$(uname -r)/modules.dep | sed 's,.*/,,;s,\.ko$,,'); do
  modprobe "$m" 2>/dev/null || echo "FAILED $m"
done
echo "LOADED $(cut -d' ' -f1 /proc/modules | tr '\n' ' ')"
"""


@pytest.fixture(scope="module")
def console(tmp_path_factory) -> list[str]:
    return run_probe(tmp_path_factory.mktemp("modules-probe"), SCRIPT, root=True,
                     timeout=600).splitlines()


def said(console: list[str], tag: str) -> list[str]:
    return [line.split(" ", 1)[1].strip() for line in console if line.startswith(tag + " ")]


@pytest.mark.parametrize("what,module", [
    ("bridge", "bridge"), ("dummy", "dummy"), ("veth", "veth"), ("vlan", "8021q"),
    ("overlay", "overlay"), ("tun", "tun"), ("fuse", "fuse"), ("nfnetlink", "nfnetlink")])
def test_the_kernel_loads_what_it_is_asked_for(console, what: str, module: str) -> None:
    results = dict(line.split(" ", 1) for line in said(console, "AUTO"))
    assert results.get(what) == "ok", (results, console[-30:])
    loaded = said(console, "LOADED")
    assert loaded and module in loaded[0].split(), console[-30:]


def test_every_shipped_module_loads_with_its_dependencies(console) -> None:
    shipped = json.loads((GUEST / "manifest.json").read_text())["on_demand_modules"]
    assert {"bridge", "nf_tables", "ip_tables", "tun", "fuse"} <= set(shipped)
    assert said(console, "FAILED") == [], console[-30:]
    loaded = set(said(console, "LOADED")[0].split())
    assert set(shipped) <= loaded, sorted(set(shipped) - loaded)
