"""`podvm-node monitor` as Prometheus sees it: the real monitor process serving a scratch
node whose sandbox.json files the real PodState code wrote (bench/monitor_bench.py makes
them, with cgroup files and real threads named as QEMU's and virtiofsd's), its /metrics
read by Prometheus' own parser. What a pod or a dying sandbox can do to a scrape is
played here too: a pod name that tries to forge samples, state files half written or
gone mid-scrape, a QEMU that has exited."""
from __future__ import annotations

import contextlib
import dataclasses
import http.client
import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from bench.monitor_bench import (CGROUP, CPUS, STATE, TEMPLATES, Threads, advance, change,
                                 fake_node, vcpu_usec)
from cgroups import SandboxLayout
from podvm_core.atomic import write_json
from podvm_core.pb.cri import api_pb2 as cri
from podvm_node.collect import Reader, _stat_fields
from podvm_node.monitor import Exposition, NodeCollector
from shim.api.sandbox import request as sandbox_request
from shim.api.task import request as task_request
from shim.host.podstate import PodState, state_path

MIB = 1 << 20
FORGED = 'evil"} 1\npodvm_node_sandboxes{x="y"} 999\n# TYPE'
"""A pod name (the Task API takes any annotation) written to forge a sample."""


class Monitor:
    """The real `podvm-node monitor` process on a free port of 127.0.0.1."""

    def __init__(self, workdir: pathlib.Path, *args: str) -> None:
        self.log = workdir / "monitor.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "podvm_node.cli", "monitor", "--listen",
                 "127.0.0.1:0", *args], stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while "serving" not in self.log.read_text():
            assert self.proc.poll() is None, self.log.read_text()
            assert time.monotonic() < deadline, self.log.read_text()
            time.sleep(0.05)
        line = next(x for x in self.log.read_text().splitlines() if "serving" in x)
        self.port = int(line.split(" on ", 1)[1].split(" ", 1)[0].rsplit(":", 1)[1])

    def get(self, path: str) -> tuple[int, str, str]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            conn.request("GET", path)
            answer = conn.getresponse()
            return answer.status, answer.getheader("Content-Type") or "", \
                answer.read().decode()
        finally:
            conn.close()

    def samples(self) -> dict[str, list]:
        """Every sample by its name, as Prometheus' parser reads the exposition."""
        status, content_type, body = self.get("/metrics")
        assert status == 200 and content_type.startswith("text/plain"), body
        out: dict[str, list] = {}
        for family in text_string_to_metric_families(body):
            for s in family.samples:
                out.setdefault(s.name, []).append(s)
        return out

    def stop(self) -> tuple[int, float]:
        """SIGTERM: the exit status and how long it took."""
        started = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        status = self.proc.wait(timeout=10)
        return status, time.monotonic() - started


def by_sandbox(samples: dict[str, list], name: str) -> dict[str, float]:
    return {s.labels["sandbox_id"]: s.value for s in samples.get(name, [])}


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    with fake_node(3, busy=0.3) as (root, states):
        ns = root / STATE / "k8s.io"
        evil = dataclasses.replace(states[2], pod_name=FORGED)
        evil.save(state_path(str(ns / evil.sandbox_id)))
        states[2] = evil
        unencodable = dataclasses.replace(states[1], pod_namespace="ns-\ud800")
        unencodable.save(state_path(str(ns / unencodable.sandbox_id)))
        states[1] = unencodable
        (ns / "half-written").mkdir()
        (ns / "half-written" / "sandbox.json").write_text('{"version": 1, "sandbox_id": "x')
        (ns / "no-state-yet").mkdir()
        gone_id = "exited" + "0" * 58
        gone = dataclasses.replace(states[0], sandbox_id=gone_id, qemu_pid=2 ** 22 - 7,
                                   cgroup=dataclasses.replace(states[0].cgroup, layout=(
                                       SandboxLayout("/kubepods/gone", gone_id))))
        (ns / gone.sandbox_id).mkdir()
        gone.save(state_path(str(ns / gone.sandbox_id)))
        templates, cpus = root / TEMPLATES, root / CPUS
        templates.mkdir(mode=0o700, parents=True)
        (templates / "k1.json").write_text(json.dumps({"command": ["-smp", "1", "-m", "256"]}))
        (templates / "k1.vmstate").write_bytes(os.urandom(64 << 10))
        cpus.mkdir(parents=True)
        born = int(pathlib.Path(f"/proc/{os.getpid()}/stat").read_text()
                   .rsplit(")", 1)[1].split()[19])
        write_json(str(cpus / "reservations.json"), {
            "live": {"cpus": [2, 3], "pid": os.getpid(), "start_time": born},
            "dead": {"cpus": [4], "pid": os.getpid(), "start_time": born + 1}})
        config = root / "etc/podvm/configuration.toml"  # found under --host-root
        config.parent.mkdir(parents=True)
        config.write_text('[hypervisor.qemu]\ntemplate_path = "/var/lib/podvm/templates"\n')
        yield root, states + [gone]


@pytest.fixture(scope="module")
def monitor(node, tmp_path_factory):
    root, _ = node
    served = Monitor(tmp_path_factory.mktemp("monitor"), "--host-root", str(root))
    yield served
    status, took = served.stop()
    assert status == 0 and took < 3, (status, took, served.log.read_text())


def test_each_sandbox_s_metrics_are_its_state(node, monitor) -> None:
    _, states = node
    samples = monitor.samples()
    running = by_sandbox(samples, "podvm_sandbox_running")
    assert set(running) == {s.sandbox_id for s in states}  # the broken ones left out
    for state in states[:3]:
        sid, plan, vm = state.sandbox_id, state.plan, state.vm
        assert vm is not None
        want = {"running": 1, "plan_vcpus": plan.vcpus,
                "plan_memory_bytes": plan.memory_mib * MIB,
                "plan_overhead_memory_bytes": plan.overhead_memory_mib * MIB,
                "plan_overhead_cpus": plan.overhead_cpu_millis / 1000,
                "guest_online_vcpus": vm.online_cpus,
                "guest_memory_total_bytes": vm.memory_total_mib * MIB,
                "boot_seconds": state.boot_seconds,
                "agent_rtt_seconds": state.agent_rtt_seconds,
                "restored": int(bool(state.restored_from))}
        got = {k: by_sandbox(samples, f"podvm_sandbox_{k}")[sid] for k in want}
        assert got == pytest.approx(want), sid
        index = int(sid[:4])  # what bench/monitor_bench.py wrote in its cgroup files
        assert by_sandbox(samples, "podvm_sandbox_memory_charged_bytes")[sid] == \
            (300 + index) * MIB
        assert by_sandbox(samples, "podvm_sandbox_host_oom_kills_total")[sid] == index % 2
        assert by_sandbox(samples, "podvm_sandbox_guest_oom_kills_total")[sid] == \
            state.guest_oom_kills
        labels = next(s.labels for s in samples["podvm_sandbox_running"]
                      if s.labels["sandbox_id"] == sid)
        assert (labels["pod"], labels["namespace"]) == (
            state.pod_name, state.pod_namespace.encode("utf-8", "replace").decode())


def test_vmm_cpu_is_split_by_thread_role(node, monitor) -> None:
    _, states = node
    cpu = [s for s in monitor.samples()["podvm_sandbox_vmm_cpu_seconds_total"]
           if s.labels["sandbox_id"] == states[0].sandbox_id]
    by_role = {s.labels["role"]: s.value for s in cpu}
    assert set(by_role) == {"vcpu", "main", "iothread", "net", "files", "other"}
    assert by_role["iothread"] >= 0.25  # it spun for 0.3 s of CPU
    # each thread's own time, not its whole process's once per thread
    assert by_role["main"] + by_role["net"] + by_role["other"] < by_role["iothread"]
    assert by_role["vcpu"] == vcpu_usec(0) / 1e6  # the vcpus/ cgroup's counter


def test_a_pod_name_cannot_forge_samples(node, monitor) -> None:
    _, states = node
    samples = monitor.samples()
    assert [s.value for s in samples["podvm_node_sandboxes"]] == [len(states)]
    assert all(s.labels == {} for s in samples["podvm_node_sandboxes"])
    evil = [s.labels["pod"] for s in samples["podvm_sandbox_running"]
            if s.labels["sandbox_id"] == states[2].sandbox_id]
    assert evil == [FORGED]
    # a name that does not encode (a lone surrogate in sandbox.json) fails no scrape
    odd = [s.labels["namespace"] for s in samples["podvm_sandbox_running"]
           if s.labels["sandbox_id"] == states[1].sandbox_id]
    assert odd == ["ns-?"]


def test_a_sandbox_whose_qemu_exited_shows_as_not_running(node, monitor) -> None:
    _, states = node
    samples = monitor.samples()
    gone = states[-1].sandbox_id
    assert by_sandbox(samples, "podvm_sandbox_running")[gone] == 0
    assert gone not in by_sandbox(samples, "podvm_sandbox_vmm_cpu_seconds_total")


def test_node_totals(node, monitor) -> None:
    samples = monitor.samples()
    assert samples["podvm_node_templates"][0].value == 1
    assert samples["podvm_node_template_bytes"][0].value >= 64 << 10
    assert samples["podvm_node_exclusive_cpus"][0].value == 2  # the dead holder's not


def test_silent_connections_do_not_stop_scrapes(monitor) -> None:
    """Clients that connect and send nothing (or half a request) hold no scrape back."""
    started = time.monotonic()
    idle = [socket.create_connection(("127.0.0.1", monitor.port)) for _ in range(40)]
    try:
        for s in idle[::2]:
            s.sendall(b"GET /metr")
        assert monitor.samples()["podvm_node_sandboxes"][0].value > 0
        assert time.monotonic() - started < 3
    finally:
        for s in idle:
            s.close()


def test_health_and_unknown_paths(monitor) -> None:
    assert monitor.get("/healthz")[::2] == (200, "ok\n")
    assert monitor.get("/metrics/../x")[0] == 404


def test_sandboxes_going_away_mid_scrape_are_skipped(tmp_path) -> None:
    with fake_node(4) as (root, states):
        reader = Reader(str(root / STATE), str(root))
        found = reader.sandboxes()
        first = next(found)
        ns = root / STATE / "k8s.io"
        shutil.rmtree(ns / states[1].sandbox_id)  # gone between two reads
        (ns / states[2].sandbox_id / "sandbox.json").write_text("{")  # being rewritten
        rest = list(found)
        assert [first.state.sandbox_id] + [b.state.sandbox_id for b in rest] == \
            [states[0].sandbox_id, states[3].sandbox_id]
        assert PodState.load(str(ns / states[3].sandbox_id / "sandbox.json")) == states[3]


class Recorded(Collector):
    """A collector whose last collect()'s families are kept."""

    def __init__(self, collector: Collector) -> None:
        self.collector, self.families = collector, []

    def collect(self):
        self.families = list(self.collector.collect())
        return iter(self.families)


class Families(Collector):
    def __init__(self, families: list) -> None:
        self.families = families

    def collect(self):
        return iter(self.families)


def test_a_scrape_serves_the_node_as_it_is_now() -> None:
    """Exposition reuses the text of a family that did not change: what it serves must
    be what prometheus_client writes for the families of that scrape, nothing stale."""
    with fake_node(2) as (root, states):
        reader = Reader(str(root / STATE), str(root))
        recorded = Recorded(NodeCollector(reader, str(root / TEMPLATES), str(root / CPUS)))
        exposition = Exposition(recorded)
        first = exposition.body()
        assert first == generate_latest(Families(recorded.families))
        advance(root, states, 1)  # memory and vCPU time moved
        changed = states[1:]
        change(root, changed)  # a new guest report and OOM kill in one sandbox
        states[1:] = changed
        second = exposition.body()
        assert second == generate_latest(Families(recorded.families)) != first
        got = {f.name: {s.labels["sandbox_id"]: s.value for s in f.samples}
               for f in text_string_to_metric_families(second.decode())
               if f.name.startswith("podvm_sandbox_")}
        for i, state in enumerate(states):
            sid = state.sandbox_id
            assert got["podvm_sandbox_guest_oom_kills"][sid] == state.guest_oom_kills
            assert got["podvm_sandbox_guest_online_vcpus"][sid] == state.vm.online_cpus
            assert got["podvm_sandbox_memory_charged_bytes"][sid] == \
                ((300 + i) << 20) + 4096  # as advance() moved it
        reader.close()


def test_a_pid_that_is_another_process_is_not_the_sandbox_s_qemu() -> None:
    """A state whose QEMU pid has another start time (a later process's) is not running,
    though that pid is in its cgroup; the same pid with the recorded start time is."""
    with fake_node(1) as (root, states):
        later = dataclasses.replace(states[0], sandbox_id="later" + "0" * 59,
                                    qemu_start_time=states[0].qemu_start_time + 1)
        (root / STATE / "k8s.io" / later.sandbox_id).mkdir()
        later.save(state_path(str(root / STATE / "k8s.io" / later.sandbox_id)))
        reader = Reader(str(root / STATE), str(root))
        for _ in range(2):  # the check is kept for the state's life: a second scrape too
            running = {b.state.sandbox_id: b.running for b in reader.sandboxes()}
            assert running == {states[0].sandbox_id: True, later.sandbox_id: False}


def test_the_reader_closes_the_files_of_what_went_away() -> None:
    """The files read at every scrape stay open between scrapes (podvm_node/collect.py's
    _Open): a thread that exited, a sandbox that went away and close() give them back."""
    with fake_node(2) as (root, states):
        def open_files() -> int:  # the reader's: under the scratch host root or /proc
            found = 0
            for fd in os.listdir("/proc/self/fd"):
                with contextlib.suppress(OSError):  # the listing's own, closed by now
                    found += os.readlink(f"/proc/self/fd/{fd}").startswith((str(root),
                                                                            "/proc/"))
            return found

        before = open_files()
        reader = Reader(str(root / STATE), str(root))
        list(reader.sandboxes())
        # each: memory.current, memory.events, cpu.stat, 2 thread lists, 7 threads' schedstat
        assert open_files() - before == 2 * 12
        worker = Threads("worker", ("worker",))
        vmm = root / CGROUP / states[0].cgroup.layout.vmm.lstrip("/") / "cgroup.threads"
        with open(vmm, "a") as f:
            f.write(f"{worker.pid}\n{worker.tids[0]}\n")
        try:
            list(reader.sandboxes())
            assert open_files() - before == 2 * 12 + 2
        finally:
            worker.close()
        list(reader.sandboxes())  # the two still listed, as a cgroup read just before
        assert open_files() - before == 2 * 12
        shutil.rmtree(root / STATE / "k8s.io" / states[1].sandbox_id)
        list(reader.sandboxes())
        assert open_files() - before == 12
        reader.close()
        assert open_files() == before


def test_a_thread_name_cannot_shift_its_fields() -> None:
    line = "77 (a) 1 2 (b) S 1 77 77 0 -1 4194560 9 0 0 0 150 50 0 0 20 0 1 0 4242 0"
    name, fields = _stat_fields(line)
    assert name == "a) 1 2 (b" and fields[11:13] == ["150", "50"] and fields[19] == "4242"


def test_a_bad_listen_address_is_refused_in_one_line(tmp_path) -> None:
    done = subprocess.run([sys.executable, "-m", "podvm_node.cli", "monitor", "--listen",
                           "nowhere"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "podvm-node monitor: --listen 'nowhere': expected ADDRESS:PORT, e.g. 0.0.0.0:8090"]


def test_both_apis_record_the_kubernetes_pod_name() -> None:
    """Where the labels come from: the sandbox's OCI annotations (Task API, containerd
    1.6/1.7) or the PodSandboxConfig's metadata (Sandbox API, containerd 2.x)."""
    spec = {"annotations": {task_request.POD_NAME: "web-0",
                            task_request.POD_NAMESPACE: "team-a"}}
    by_task = task_request.pod_request("k8s.io", "sb1", spec)
    config = cri.PodSandboxConfig(metadata=cri.PodSandboxMetadata(name="web-1",
                                                                  namespace="team-b"))
    by_sandbox = sandbox_request.pod_request("k8s.io", "sb2", config, {}, "")
    assert (by_task.pod_name, by_task.pod_namespace) == ("web-0", "team-a")
    assert (by_sandbox.pod_name, by_sandbox.pod_namespace) == ("web-1", "team-b")
    unnamed = task_request.pod_request("k8s.io", "sb3", {})  # ctr run: no Kubernetes pod
    assert (unnamed.pod_name, unnamed.pod_namespace) == ("", "")


def test_each_pod_s_disk_size_and_use_are_exported(tmp_path) -> None:
    """The scratch disk's size from the plan, and what it takes on the host: the blocks
    of the unnamed file its QEMU holds, found by the inode sandbox.json records."""
    from podvm_node.collect import Sandbox
    from podvm_node.monitor import SandboxFamilies
    from tests.host.test_diskreserve import HOLDER
    from tests.host.test_podstate import state

    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None
        inode = int(holder.stdout.readline())
        pod = state(sandbox_id="disk", qemu_pid=holder.pid, scratch_inode=inode)
        pod = dataclasses.replace(pod, plan=dataclasses.replace(pod.plan, disk_mib=512))
        families = {f.name: {s.labels["sandbox_id"]: s.value for s in f.samples}
                    for f in SandboxFamilies().families([Sandbox("k8s.io", pod, True)])}
        assert families["podvm_sandbox_plan_disk_bytes"] == {"disk": 512 * MIB}
        assert families["podvm_sandbox_disk_used_bytes"] == {"disk": 8 * MIB}
        stopped = SandboxFamilies().families([Sandbox("k8s.io", pod, False)])
        assert {f.name: len(f.samples) for f in stopped}["podvm_sandbox_disk_used_bytes"] == 0
    finally:
        holder.kill()
        holder.wait()
