"""Templates (shim/vm/template/template.py, shim/vm/template/maker.py) through the CRI,
as a user sees them: on a fresh node `podvmctl templates warm` makes the default shape's
template before any pod, so the very first pod restores it, and each restored pod is the
pod it asked for: the host's clock, its own MAC on its own network (served over HTTP to the
host; no frame from the template's MAC on it), its containers on its own virtio-fs
share, its own boot id, random bytes and TCP initial sequence numbers (the other pod,
restored from the same template, has others). A pod of another size is restored from the
same template and grown to its plan by hot-plug. A pod whose shape has no template boots
at once, and its shim makes that template in the background, in the templates' own
cgroup; a template that no longer restores is discarded and the pod boots instead.

The pods are on the test containerd's private bridge (testbed/bridgenet.py); every
wait is bounded."""
from __future__ import annotations

import json
import os
import pathlib
import re
import socket
import subprocess
import sys
import time

import pytest

from podvmctl import status
from shim.resources.annotations import KATA
from shim.vm import stateload
from shim.vm.hypervisor import template_mac
from testbed.containerd import Containerd, shims_of
from testbed.cri import Crictl, write_config
from testbed.netpods import fetch_from_host, httpd_script, pod_ip, url, wait_for_port
from testbed.pods import pod_config, podvm_leftovers, qemus
from testbed.vmconfig import TEMPLATE_CGROUP, write_test_config

from .test_crictl import run_container, wait_for
from .test_podvm_pods import cri_containerd, remove_pod, runp

ETH_P_ALL = 0x0003
TEMPLATE_AGE = 8.0
"""Seconds a template is at least old when the next pod restores it: without Resume its
clock would be behind by that much."""


@pytest.fixture(scope="module")
def ctd(tmp_path_factory, image_cache, pod_network):
    """Pods on the bridge whose templates are this module's own (not the run's warmed
    ones): each test sees which its pods make."""
    store = tmp_path_factory.mktemp("templates-store") / "store"
    for c in cri_containerd(tmp_path_factory, image_cache, "templates", "podvm-template-test",
                            template_path=str(store),
                            enable_annotations=("default_vcpus", "default_memory")):
        c.templates = store  # type: ignore[attr-defined]
        yield c


@pytest.fixture(scope="module")
def crictl(ctd) -> Crictl:
    return Crictl(ctd.cri_endpoint, timeout="180s")


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> pathlib.Path:
    return tmp_path_factory.mktemp("template-configs")


def templates(ctd: Containerd) -> dict[str, dict]:
    """key -> metadata of the templates in the test's store."""
    store = ctd.templates  # type: ignore[attr-defined]
    found = {}
    for meta in store.glob("*.json") if store.is_dir() else ():
        found[meta.stem] = json.loads(meta.read_text())
        assert (store / f"{meta.stem}.vmstate").stat().st_size > 0
    return found


class FrameSniffer:
    """Every frame on `bridge` while it is open (an AF_PACKET socket: the host's side of
    the pods' network), for the MACs they came from."""

    def __init__(self, bridge: str) -> None:
        self.bridge = bridge
        self.sock: socket.socket | None = None

    def __enter__(self) -> "FrameSniffer":
        self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        self.sock.bind((self.bridge, 0))
        self.sock.setblocking(False)
        self.frames: list[bytes] = []
        return self

    def __exit__(self, *exc) -> None:
        assert self.sock is not None
        self._drain()
        self.sock.close()

    def _drain(self) -> None:
        assert self.sock is not None
        while True:
            try:
                self.frames.append(self.sock.recv(2048))
            except BlockingIOError:
                return

    def sources(self) -> set[str]:
        return {":".join(f"{b:02x}" for b in frame[6:12]) for frame in self.frames}


def first_syns(ctd: Containerd, crictl: Crictl, containers) -> dict[str, int]:
    """Source IP -> sequence number of the first SYN each container sends to one peer on
    the host (a port of the bridge's gateway address, seen on the bridge)."""
    with socket.socket() as peer:  # bound, not listening: the SYN is answered by a reset
        peer.bind((str(ctd.network.gateway), 0))
        port = peer.getsockname()[1]
        with FrameSniffer(ctd.network.bridge) as sniffer:
            for c in containers:  # wget fails at once; its SYN is what counts
                crictl.exec(c, "wget", "-q", "-O", "/dev/null",
                            f"http://{ctd.network.gateway}:{port}/", timeout=30)
    syns: dict[str, int] = {}
    for frame in sniffer.frames:
        if frame[12:14] != b"\x08\x00" or frame[23] != socket.IPPROTO_TCP:
            continue
        tcp = frame[14 + (frame[14] & 0x0F) * 4:]
        if int.from_bytes(tcp[2:4], "big") == port and tcp[13] & 0x12 == 0x02:  # SYN only
            syns.setdefault(socket.inet_ntoa(frame[26:30]), int.from_bytes(tcp[4:8], "big"))
    return syns


def shim_lines(ctd: Containerd, pod_id: str, needle: str) -> list[str]:
    return [line for line in ctd.log().splitlines() if pod_id in line and needle in line]


def netns_mac(crictl: Crictl, pod_id: str, ifname: str = "eth0") -> str:
    """The MAC CNI gave `ifname` in the pod's namespace on the host."""
    namespaces = crictl.inspectp(pod_id)["info"]["runtimeSpec"]["linux"]["namespaces"]
    path = next(n["path"] for n in namespaces if n["type"] == "network")
    done = subprocess.run(["nsenter", f"--net={path}", "ip", "-j", "link", "show", ifname],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)[0]["address"]


def chunks_read_from_cache(ctd: Containerd, pod_id: str, key: str) -> tuple[int, int] | None:
    """Of the pod's template's chunks of memory (those with data), how many its copy read
    from the host's page cache, as its shim said; None if it did not restore `key`."""
    for line in shim_lines(ctd, pod_id, f"VM restored from template {key}, "):
        found = re.search(r"(\d+) of its (\d+) chunks of memory read from the page cache",
                          line)
        if found:
            return int(found[1]), int(found[2])
    return None


def mostly_cached(chunks: str) -> bool:
    """More than half of the data chunks are in the page cache (cached_chunks' form)."""
    return chunks.count("1") > chunks.count("0")


def warm(ctd: Containerd, *shapes: str) -> str:
    """`podvmctl templates warm` with the test containerd's configuration; what it said."""
    done = subprocess.run(
        [sys.executable, "-m", "podvmctl.cli", "templates", "warm", "--config",
         str(ctd.podvm_config), *(f"--shape={s}" for s in shapes)],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_node_warmed_ahead_restores_its_first_pod_and_each_pod_is_its_own(
        ctd, crictl, configs) -> None:
    assert templates(ctd) == {}, "a fresh node"
    said = warm(ctd)
    made = templates(ctd)
    assert len(made) == 1, (said, made)
    key = next(iter(made))
    assert f"1:256:1:1500: template {key} made" in said, said
    assert made[key]["made_by"].startswith("warm-")
    assert f"template {key} exists" in warm(ctd), "warm again: nothing made"
    # Made, then kept in the page cache, charged to the templates' cache cgroup. (Most of
    # it: the host may reclaim any of its clean pages at any time; this one's DAMON pages
    # out memory it finds idle, so a few chunks may be gone by the next look.)
    memory = str(ctd.templates / f"{key}.vmstate.ram")  # type: ignore[attr-defined]
    assert mostly_cached(stateload.cached_chunks(memory))
    # (the default shape's template holds 70-100 MiB of data; a cache charged none, 0)
    assert int(pathlib.Path(f"/sys/fs/cgroup/memory{TEMPLATE_CGROUP}/podvm_templates-cache/"
                            f"memory.usage_in_bytes").read_text()) >= 32 << 20
    first, first_file = runp(crictl, ctd, configs, "tpl-first")
    try:
        read = chunks_read_from_cache(ctd, first, key)
        assert read and read[0] > read[1] / 2, \
            f"the first pod restores the template made ahead, mostly from RAM: {read}"
        # The template is old enough that a clock left as saved would show it.
        saved = (ctd.templates / f"{key}.vmstate").stat().st_mtime  # type: ignore[attr-defined]
        time.sleep(max(0.0, saved + TEMPLATE_AGE - time.time()))

        fd = os.open(memory, os.O_RDONLY)  # as the host's memory pressure would
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        assert not stateload.resident(memory)
        with FrameSniffer(ctd.network.bridge) as sniffer:
            second, pod_file = runp(crictl, ctd, configs, "tpl-second")
        try:
            # Read from disk, then warmed again off the pod's path.
            read = chunks_read_from_cache(ctd, second, key)
            assert read and read[0] == 0, read
            wait_for("the template warmed again",
                     lambda: mostly_cached(stateload.cached_chunks(memory)))
            # Nothing of the template on the pod's network: QEMU announces no MAC after
            # the load, so the template's is never seen (every pod would send it).
            sent = sniffer.sources()
            assert template_mac(0) not in sent, f"frames from the template's MAC: {sent}"
            assert shim_lines(ctd, second, f"VM restored from template {key}")
            assert len(templates(ctd)) == 1, "the second pod made no template of its own"
            cid = run_container(crictl, configs, second, pod_file, "tpl-web",
                                httpd_script("restored"))
            # Its own network: the pod's MAC on the guest's eth0, HTTP from the host.
            guest = crictl.exec(cid, "cat", "/sys/class/net/eth0/address", timeout=30)
            assert guest.exit_code == 0, guest.stderr
            assert guest.stdout.strip() == netns_mac(crictl, second)
            wait_for_port(crictl, cid)
            assert fetch_from_host(url(pod_ip(crictl, second))).strip() == "restored"
            # The host's clock, not the template's.
            before = time.time()
            date = crictl.exec(cid, "date", "+%s", timeout=30)
            after = time.time()
            assert date.exit_code == 0, date.stderr
            assert before - 1 <= int(date.stdout) <= after + 1, \
                f"guest clock {date.stdout.strip()}, host {before:.0f}-{after:.0f}"
            # Its containers: their images from the pod's own share (virtio-fs, the
            # default), their writable layers on the pod's own scratch disk.
            mounts = crictl.exec(cid, "cat", "/proc/mounts", timeout=30)
            assert mounts.exit_code == 0, mounts.stderr
            layer = f"/run/podvm/scratch/layers/{cid}"
            assert " / overlay " in mounts.stdout and \
                f"lowerdir=/run/podvm/shared/{cid}/rootfs/.,upperdir={layer}/" \
                in mounts.stdout and " virtiofs " in mounts.stdout, mounts.stdout
            # Both pods woke from the same saved guest, yet each has its own boot id:
            # the kernel draws it at its first read, which no template may make.
            other = run_container(crictl, configs, first, first_file, "tpl-first-c",
                                  "sleep 600")
            drawn = [crictl.exec(c, "cat", "/proc/sys/kernel/random/boot_id", timeout=30)
                     for c in (cid, other)]
            assert all(d.exit_code == 0 and d.stdout.strip() for d in drawn), drawn
            assert drawn[0].stdout != drawn[1].stdout, drawn
            # And each its own randomness: the first bytes its container reads from
            # /dev/urandom and /dev/random (getrandom(2)'s CRNG since Linux 5.6; the agent's
            # Resume reseeded it with host entropy), and the initial sequence number of a
            # TCP connection to one peer on the host (from the kernel's TCP secret, drawn
            # at its first use, which no template makes).
            randoms = [crictl.exec(c, "sh", "-c", "head -c 16 /dev/urandom | od -An -tx1; "
                                   "head -c 16 /dev/random | od -An -tx1", timeout=30)
                       for c in (cid, other)]
            assert all(r.exit_code == 0 and len(r.stdout.split()) == 32 for r in randoms), \
                randoms
            assert randoms[0].stdout != randoms[1].stdout, randoms
            isns = first_syns(ctd, crictl, (cid, other))
            assert len(isns) == 2 and len(set(isns.values())) == 2, isns
        finally:
            remove_pod(crictl, second)
    finally:
        remove_pod(crictl, first)


def the_template(ctd: Containerd) -> str:
    """The key of the default shape's template, warmed when the tests before (run alone:
    -k) made none."""
    made = templates(ctd)
    if not made:
        warm(ctd)
        made = templates(ctd)
    assert len(made) == 1, made
    return next(iter(made))


def made_in_the_background(ctd: Containerd, pod: str, key: str | None = None,
                           watch: bool = True) -> str:
    """The key of the template `pod`'s shim makes after the pod booted, once it is
    saved; with `watch` (called as soon as the pod is ready: the make takes seconds),
    its VM (`<pod>-template`) seen running in the templates' cgroup, never in the pod's."""
    name = f"podvm-{pod}-template".encode()

    def maker_cgroups() -> str:
        for pid in qemus():
            try:
                if name in pathlib.Path(f"/proc/{pid}/cmdline").read_bytes():
                    return pathlib.Path(f"/proc/{pid}/cgroup").read_text()
            except OSError:
                continue
        return ""

    if watch:
        groups = wait_for("the template's VM", maker_cgroups, timeout=60)
        memory = next(line for line in groups.splitlines() if ":memory:" in line)
        assert memory.split(":", 2)[2].startswith(f"{TEMPLATE_CGROUP}/podvm_template-"), \
            groups
        assert pod not in groups, groups

    def saved() -> str:
        return next((k for k, meta in templates(ctd).items() if meta["made_by"] == pod
                     and (key is None or k == key)), "")

    found = wait_for("the template made in the background", saved, timeout=180)
    # the shim says so once the maker has returned, after the files are in the store
    wait_for("the shim's line about it", lambda: shim_lines(
        ctd, pod, f"template {found} made in the background"), timeout=30)
    return found


def test_a_pod_of_another_size_is_restored_from_the_template_and_grown_to_its_plan(
        ctd, crictl, configs) -> None:
    """vCPUs and memory mint no template (a pod author varying them cannot fill the
    node's disk): a pod of 2 vCPUs and 256 + 3 x 128 MiB restores the default shape's
    template, then gets exactly its own size by hot-plug before its first container."""
    key = the_template(ctd)
    pod_file = write_config(configs, "pod-tpl-big.json", pod_config(
        ctd, configs, "tpl-big", annotations={KATA + "default_vcpus": "2",
                                              KATA + "default_memory": "640"}))
    pod = crictl.runp(pod_file, runtime="podvm")
    try:
        assert shim_lines(ctd, pod, f"VM restored from template {key}")
        assert shim_lines(ctd, pod, "grown to 2 and 640 MiB"), ctd.log()[-3000:]
        assert list(templates(ctd)) == [key], "no template of the pod's own size"
        vm = json.loads((pathlib.Path(status.find(pod)) / "sandbox.json").read_text())["vm"]
        assert (vm["online_cpus"], vm["qemu_memory_mib"]) == (2, 640), vm
        cid = run_container(crictl, configs, pod, pod_file, "tpl-big-c", "sleep 600")
        seen = crictl.exec(cid, "sh", "-c", "nproc; grep MemTotal /proc/meminfo", timeout=30)
        assert seen.exit_code == 0, seen.stderr
        cpus, meminfo = seen.stdout.split("\n", 1)
        assert int(cpus) == 2
        # The guest's own kernel and its memory map take some of the 640 MiB.
        assert int(meminfo.split()[1]) >= 0.85 * 640 * 1024, meminfo
    finally:
        remove_pod(crictl, pod)


def test_a_template_that_does_not_restore_is_discarded_and_the_pod_boots(
        ctd, crictl, configs) -> None:
    key = the_template(ctd)
    state = ctd.templates / f"{key}.vmstate"  # type: ignore[attr-defined]
    with open(state, "r+b") as f:  # what a full disk or a torn copy leaves
        f.truncate(os.path.getsize(state) // 2)

    pod, pod_file = runp(crictl, ctd, configs, "tpl-broken")
    try:
        assert shim_lines(ctd, pod, "discarded"), "the broken template is discarded"
        assert not shim_lines(ctd, pod, "VM restored from template")
        cid = run_container(crictl, configs, pod, pod_file, "tpl-after", "sleep 600")
        r = crictl.exec(cid, "true", timeout=30)
        assert r.exit_code == 0, r.stderr
        # Its shim makes the shape's template anew (perhaps made already: its VM is
        # watched in the next test), and the next pod restores it.
        assert made_in_the_background(ctd, pod, key, watch=False) == key
    finally:
        remove_pod(crictl, pod)
    pod, _ = runp(crictl, ctd, configs, "tpl-remade")
    try:
        assert list(templates(ctd)) == [key]
        assert shim_lines(ctd, pod, f"VM restored from template {key}")
    finally:
        remove_pod(crictl, pod)


def test_a_shim_killed_while_its_template_is_made_leaves_nothing(ctd, crictl,
                                                                 configs) -> None:
    """The crash a pod's background template make must survive: its shim SIGKILLed while
    the template's VM boots. containerd's `shim delete` then removes the template's VM
    and cgroup too (recorded in sandbox.json before it was made), and the half-written
    files go at the store's next prune; nothing of the pod is left, and no template."""
    pod_file = write_config(configs, "pod-tpl-killed.json", pod_config(
        ctd, configs, "tpl-killed", annotations={KATA + "default_memory": "259"}))
    pod = crictl.runp(pod_file, runtime="podvm")
    try:
        name = f"podvm-{pod}-template".encode()

        def maker() -> tuple[int, str] | None:
            for pid in qemus():
                try:
                    if name in pathlib.Path(f"/proc/{pid}/cmdline").read_bytes():
                        return pid, pathlib.Path(f"/proc/{pid}/cgroup").read_text()
                except OSError:
                    continue
            return None

        vm, groups = wait_for("the template's VM", maker, timeout=60)
        memory = next(line for line in groups.splitlines() if ":memory:" in line)
        cgroup = pathlib.Path("/sys/fs/cgroup/memory" + memory.split(":", 2)[2])
        assert cgroup.is_dir()
        shim, = (pid for pid, cmd in shims_of(ctd.address) if pod in cmd)
        os.kill(shim, 9)
    finally:
        remove_pod(crictl, pod)
    wait_for("the template's VM to go", lambda: not os.path.exists(f"/proc/{vm}"),
             timeout=30)
    assert not cgroup.exists(), cgroup
    # template_cgroup itself goes once empty; what an earlier pod's warm-up left there, the
    # templates' page cache cgroup (shim/vm/template/cache.py), stays by design
    assert not cgroup.parent.exists() or [p.name for p in cgroup.parent.iterdir()
                                          if p.is_dir()] == ["podvm_templates-cache"]
    assert podvm_leftovers(ctd, pod) == []
    assert not [k for k, meta in templates(ctd).items() if meta["made_by"] == pod]
    warm(ctd)  # a make: its prune takes what the killed maker wrote
    assert not [n for n in os.listdir(ctd.templates) if ".tmp" in n], \
        os.listdir(ctd.templates)  # type: ignore[attr-defined]


def test_a_pod_of_a_new_shape_boots_at_once_and_a_flood_keeps_the_store_within_its_cap(
        ctd, crictl, configs) -> None:
    """A pod whose shape has no template (here the memory's remainder modulo 128 MiB, what
    a pod author can still vary) waits for none: it boots, and its shim then makes the
    shape's template beside it, in the templates' cgroup. Shapes never mint more than
    template_max_count (1 here): the new shape's template takes the place of the least
    recently used one, the default shape's, and the next pod of the shape restores it.
    Last in the module: it leaves the store with a template of another shape."""
    default = the_template(ctd)
    config = pathlib.Path(ctd.podvm_config)
    good = config.read_text()
    write_test_config(config, template_path=str(ctd.templates), template_max_count=1,
                      enable_annotations=("default_vcpus", "default_memory"))
    try:
        pods = []
        for name in ("tpl-flood", "tpl-flood-2"):
            pod_file = write_config(configs, f"pod-{name}.json", pod_config(
                ctd, configs, name, annotations={KATA + "default_memory": "257"}))
            pods.append(crictl.runp(pod_file, runtime="podvm"))
            if len(pods) == 1:
                assert not shim_lines(ctd, pods[0], "VM restored from template")
                key = made_in_the_background(ctd, pods[0])
                made = templates(ctd)
                assert list(made) == [key] and default not in made, made
                assert "257M,slots=8" in " ".join(made[key]["command"])
        assert shim_lines(ctd, pods[1], f"VM restored from template {key}")
    finally:
        for pod in pods:
            remove_pod(crictl, pod)
        config.write_text(good)
