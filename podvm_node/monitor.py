"""`podvm-node monitor`: the node's sandboxes as Prometheus metrics (kata-monitor's job),
on `/metrics`, with `/healthz` for the kubelet. Everything is read at scrape time by one
custom collector (podvm_node/collect.py reads the files), so a scrape shows the node as
it is then (only a sandbox.json that did not change is not parsed again); it never talks
to a shim, so no scrape waits on one. prometheus_client writes the exposition, family by
family, and a family whose samples did not change since the last scrape is not written
again (Exposition)."""
from __future__ import annotations

import argparse
import logging
import os
import resource
import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from shim import config
from shim.cpus.allocator import DEFAULT_DIR as CPUS_DIR, Allocator, AllocatorError
from shim.host import diskreserve, paths
from shim.host.podstate import PodState
from shim.vm.template import store as templatestore

from .collect import Reader, Sandbox, rooted

log = logging.getLogger("podvm.monitor")
MIB = 1 << 20
LABELS = ("namespace", "pod", "sandbox_id")
"""Kubernetes' namespace and pod name ("" outside Kubernetes), and the sandbox id."""
DEFAULT_LISTEN = "0.0.0.0:8090"

SANDBOX_GAUGES: tuple[tuple[str, str], ...] = (
    ("running", "1 while the sandbox's QEMU runs, 0 when it has exited."),
    ("plan_vcpus", "vCPUs the plan gives the VM at boot."),
    ("plan_uncapped_vcpus", "vCPUs the pod asked for before the node's cap (only where "
                            "capped)."),
    ("plan_memory_bytes", "Memory the plan gives the VM at boot."),
    ("plan_overhead_memory_bytes", "The RuntimeClass memory overhead the plan expects."),
    ("plan_overhead_cpus", "The RuntimeClass CPU overhead the plan expects."),
    ("guest_online_vcpus", "vCPUs online in the guest, as it last reported."),
    ("guest_memory_total_bytes", "The guest's MemTotal, as it last reported."),
    ("memory_charged_bytes", "Memory the host charges the sandbox cgroup now."),
    ("plan_disk_bytes", "The pod's scratch disk: its ephemeral-storage limits and emptyDir "
                        "sizeLimits plus ext4's share, the most it takes on the host."),
    ("disk_used_bytes", "Host disk the pod's scratch disk takes now (its allocated blocks)."),
    ("boot_seconds", "From QEMU's launch (or restore) to the guest agent's first answer."),
    ("restored", "1 when the VM was restored from a template, 0 when it booted."),
    ("agent_rtt_seconds", "One round trip to the guest agent, timed once it was up."),
)
RUNNING, CHARGED = "podvm_sandbox_running", "podvm_sandbox_memory_charged_bytes"
DISK_USED = "podvm_sandbox_disk_used_bytes"
CPU, HOST_OOM, GUEST_OOM = (f"podvm_sandbox_{name}_total" for name in (
    "vmm_cpu_seconds", "host_oom_kills", "guest_oom_kills"))
"""The samples' names (a counter's have _total, as CounterMetricFamily.add_metric's)."""


class NodeCollector(Collector):
    """One scrape: every sandbox's state read anew, and the node's totals."""

    def __init__(self, reader: Reader, template_path: str, cpus_dir: str = CPUS_DIR
                 ) -> None:
        self.reader = reader
        self.template_path = template_path
        self.cpus_dir = cpus_dir
        self._allocator: Allocator | None = None
        self._sandboxes = SandboxFamilies(reader.proc)

    def collect(self) -> Iterator[Metric]:
        sandboxes = list(self.reader.sandboxes())
        yield from self._sandboxes.families(sandboxes)
        yield from self._node(sandboxes)

    def _node(self, sandboxes: list[Sandbox]) -> Iterator[Metric]:
        yield GaugeMetricFamily("podvm_node_sandboxes", "Sandboxes with a state on the node.",
                                value=len(sandboxes))
        try:
            found = templatestore.listing(self.template_path)
        except OSError as exc:  # the metrics are left out, the scrape goes on
            log.warning("templates in %s: %s", self.template_path, exc)
        else:
            yield GaugeMetricFamily("podvm_node_templates", "VM templates in the store.",
                                    value=len(found))
            yield GaugeMetricFamily("podvm_node_template_bytes",
                                    "Bytes the VM templates take on disk.",
                                    value=sum(t["bytes"] for t in found))
        cpus = self._exclusive_cpus()
        if cpus is not None:
            yield GaugeMetricFamily("podvm_node_exclusive_cpus",
                                    "Host CPUs held exclusively by running pods.", value=cpus)

    def _exclusive_cpus(self) -> int | None:
        """None where the reservations cannot be read (the metric is left out)."""
        try:
            if self._allocator is None:
                self._allocator = Allocator(self.cpus_dir)
            return sum(len(c) for c in self._allocator.reservations().values())
        except (AllocatorError, OSError, ValueError) as exc:
            log.warning("exclusive CPUs: %s", exc)
            return None


class Exposition:
    """The `/metrics` body as prometheus_client's generate_latest writes it, one family
    at a time: a family equal to the last scrape's (the plan, the guest's report, boot,
    restore, OOM kills, running: most of them, most scrapes) keeps its text. Writing a
    sample costs prometheus_client ~13 us on the 2-CPU development machine, so writing
    all ~1,900 of 100 sandboxes every time was half a scrape."""

    def __init__(self, collector: Collector) -> None:
        self.collector = collector
        self._written: dict[str, tuple[Metric, bytes]] = {}
        self._lock = threading.Lock()

    def body(self) -> bytes:
        """One scrape at a time: a flood of scrapes costs one scrape's CPU at once."""
        with self._lock:
            written: dict[str, tuple[Metric, bytes]] = {}
            for metric in self.collector.collect():
                last = self._written.get(metric.name)
                if last is None or last[0] != metric:
                    last = (metric, generate_latest(_Family(metric)))
                written[metric.name] = last
            self._written = written
            return b"".join(text for _, text in written.values())


class _Family(Collector):
    def __init__(self, metric: Metric) -> None:
        self.metric = metric

    def collect(self) -> Iterator[Metric]:
        yield self.metric


class SandboxFamilies:
    """Every sandbox's families for one scrape. What a sandbox's state alone says (its
    labels, plan, guest report, boot, restore, agent round trip, guest OOM kills) is made
    samples once per state (the Reader hands the same PodState while sandbox.json is
    unchanged); a scrape adds the samples of what it read."""

    def __init__(self, proc: str = "/proc") -> None:
        self._made: dict[tuple[str, str], tuple[PodState, dict[str, str], list[Sample]]] = {}
        self._proc = proc
        """The host's /proc, where a QEMU's descriptors lead to its pod's scratch disk."""

    def families(self, sandboxes: Iterable[Sandbox]) -> list[Metric]:
        gauges = {name: GaugeMetricFamily(f"podvm_sandbox_{name}", text, labels=LABELS)
                  for name, text in SANDBOX_GAUGES}
        cpu = CounterMetricFamily(
            "podvm_sandbox_vmm_cpu_seconds", "CPU time of the pod's host threads, by role "
            "(vcpu, main, iothread, net, files, shim, other).", labels=LABELS + ("role",))
        host_oom = CounterMetricFamily("podvm_sandbox_host_oom_kills",
                                       "OOM kills in the sandbox cgroup (the host's).",
                                       labels=LABELS)
        guest_oom = CounterMetricFamily("podvm_sandbox_guest_oom_kills",
                                        "Containers the guest's OOM killer ended.",
                                        labels=LABELS)
        by_name = {m.name: m for m in gauges.values()} | {GUEST_OOM: guest_oom}
        made: dict[tuple[str, str], tuple[PodState, dict[str, str], list[Sample]]] = {}
        for box in sandboxes:
            key = (box.namespace, box.state.sandbox_id)
            _, labels, samples = made[key] = self._of(key, box.state)
            for sample in samples:
                by_name[sample.name].samples.append(sample)
            gauges["running"].samples.append(Sample(RUNNING, labels, int(box.running)))
            if box.memory_bytes is not None:
                gauges["memory_charged_bytes"].samples.append(
                    Sample(CHARGED, labels, box.memory_bytes))
            disk = diskreserve.of_pod(box.state, None, self._proc) if box.running else None
            if disk is not None:
                gauges["disk_used_bytes"].samples.append(
                    Sample(DISK_USED, labels, disk.st_blocks * 512))
            for role, seconds in sorted(box.cpu_seconds.items()):
                cpu.samples.append(Sample(CPU, {**labels, "role": role}, seconds))
            if box.host_oom_kills is not None:
                host_oom.samples.append(Sample(HOST_OOM, labels, box.host_oom_kills))
        self._made = made
        return [*gauges.values(), cpu, host_oom, guest_oom]

    def _of(self, key: tuple[str, str], state: PodState
            ) -> tuple[PodState, dict[str, str], list[Sample]]:
        made = self._made.get(key)
        if made is not None and made[0] is state:
            return made
        labels = {"namespace": _text(state.pod_namespace), "pod": _text(state.pod_name),
                  "sandbox_id": state.sandbox_id}  # one dict: the samples only read it
        return state, labels, [Sample(f"podvm_sandbox_{name}", labels, value)
                               for name, value in state_values(state).items()] + [
            Sample(GUEST_OOM, labels, state.guest_oom_kills)]


def state_values(state: PodState) -> dict[str, float]:
    """The gauges a sandbox's state decides; those it has no value for yet are left out."""
    plan, vm = state.plan, state.vm
    values: dict[str, float] = {
        "plan_vcpus": plan.vcpus, "plan_memory_bytes": plan.memory_mib * MIB,
        "plan_overhead_memory_bytes": plan.overhead_memory_mib * MIB,
        "plan_overhead_cpus": plan.overhead_cpu_millis / 1000,
        "restored": int(bool(state.restored_from))}
    if plan.uncapped_vcpus > plan.vcpus:
        values["plan_uncapped_vcpus"] = plan.uncapped_vcpus
    if plan.disk_mib:
        values["plan_disk_bytes"] = plan.disk_mib * MIB
    if vm is not None:
        values["guest_online_vcpus"] = vm.online_cpus
        values["guest_memory_total_bytes"] = vm.memory_total_mib * MIB
    if state.boot_seconds:
        values["boot_seconds"] = state.boot_seconds
    if state.agent_rtt_seconds:
        values["agent_rtt_seconds"] = state.agent_rtt_seconds
    return values


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128
    """socketserver's 5 would make a burst of connections wait on SYN retries."""


def _text(value: str) -> str:
    """A label value that encodes: a lone surrogate (JSON allows one) would fail the
    whole scrape's UTF-8 encoding."""
    return value.encode("utf-8", "replace").decode("utf-8")


class Handler(BaseHTTPRequestHandler):
    exposition: Exposition
    timeout = 10
    """Seconds a connection may stay silent: a client holding one open costs a thread."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            self._send(200, self.exposition.body(), CONTENT_TYPE_LATEST)
        elif path == "/healthz":
            self._send(200, b"ok\n", "text/plain; charset=utf-8")
        else:
            self._send(404, b"not found: /metrics or /healthz\n", "text/plain; charset=utf-8")

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        log.debug(format, *args)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="podvm-node monitor", description=__doc__)
    p.add_argument("--listen", default=DEFAULT_LISTEN, help="ADDRESS:PORT to serve on "
                   f"(default {DEFAULT_LISTEN})")
    p.add_argument("--host-root", default="/", help="where the host's / is mounted (the "
                   "DaemonSet's /host): the other paths, and the cgroups and /proc the "
                   "sandboxes are read in, are the host's under it (default /)")
    p.add_argument("--state-root", default=paths.STATE_ROOT,
                   help=f"where the shims keep their sandboxes (default {paths.STATE_ROOT})")
    p.add_argument("--config", default="", help="the podvm configuration the node uses, for "
                   f"its template store (default: the host's ${config.ENV_PATH}, else "
                   f"{config.DEFAULT_PATH}, else built-in defaults)")
    p.add_argument("--cpus-dir", default=CPUS_DIR, help="the exclusive CPU reservations' "
                   f"directory (default {CPUS_DIR})")
    return p


def listen_address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"--listen {text!r}: expected ADDRESS:PORT, e.g. {DEFAULT_LISTEN}")
    return host.strip("[]") or "0.0.0.0", int(port)


def node_config(host_root: str, path: str) -> config.Config:
    """The host's podvm configuration, found as the shim finds it (shim/config.py)."""
    path = path or os.environ.get(config.ENV_PATH, "")
    if path:
        return config.load(rooted(host_root, path))
    default = rooted(host_root, config.DEFAULT_PATH)
    return config.load(default) if os.path.exists(default) else config.Config()


def raise_open_files_limit() -> None:
    """The reader keeps about a dozen files a sandbox open (podvm_node/collect.py): the
    soft limit (1024 where systemd leaves it) goes up to the hard one."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as exc:  # an unlimited hard limit the kernel caps
        log.warning("open files limit: %s", exc)


def main(command: str = "monitor", argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="podvm-node monitor: %(message)s")
    try:
        host, port = listen_address(args.listen)
        cfg = node_config(args.host_root, args.config)
    except (ValueError, config.ConfigError) as exc:
        print(f"podvm-node monitor: {exc}", file=sys.stderr)
        return 2
    raise_open_files_limit()
    exposition = Exposition(NodeCollector(
        Reader(rooted(args.host_root, args.state_root), args.host_root),
        rooted(args.host_root, cfg.qemu.template_path), rooted(args.host_root, args.cpus_dir)))
    handler = type("NodeHandler", (Handler,), {"exposition": exposition})
    try:
        server = Server((host, port), handler)
    except OSError as exc:
        print(f"podvm-node monitor: cannot listen on {args.listen}: {exc}", file=sys.stderr)
        return 1
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    log.info("serving /metrics on %s:%d (sandboxes under %s)", host, server.server_port,
             args.state_root)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
