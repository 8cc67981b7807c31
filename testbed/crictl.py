"""A crictl-compatible command line client: `python -m testbed.crictl [flags] COMMAND`.

Tests drive containerd's CRI plugin the way kubelet and operators do, with crictl's
arguments, file formats and output, without needing the crictl binary (not packaged for
Debian 12, and no network to fetch it). testbed/cri.py runs this module, or the real
crictl when $CRICTL names one, with the same arguments.

Differences from crictl: `exec -s` exits with the command's own status and keeps its
stdout and stderr apart (crictl exits 1 with "command ... exited with N" and prints both
streams to stdout); `exec` without -s also uses ExecSync (no streaming client, so no
-i/-t); `port-forward` speaks the streaming server's websocket protocol (crictl's:
SPDY); configs are JSON (YAML only when PyYAML is installed) and may also use camelCase
names and enum names (crictl's Go decoder takes snake_case names and numbers only); only
JSON output for inspect* and info.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from typing import Any, Iterable

import grpc
from google.protobuf import json_format, message

from podvm_core.pb.cri import api_pb2 as cri

from .criclient import CriClient, CriError

DEFAULT_CONFIG = "/etc/crictl.yaml"
DEFAULT_ENDPOINTS = ("unix:///run/containerd/containerd.sock", "unix:///run/crio/crio.sock",
                     "unix:///var/run/cri-dockerd.sock")
DEFAULT_TIMEOUT = 2.0
CLIENT_VERSION = "0.1.0"  # the Version request's version, as kubelet and crictl send it


class Fatal(Exception):
    """An error crictl reports with `FATA[0000] ...` and exit status 1."""


class ExitCode(Exception):
    """Leave with this status and nothing more to print (exec's command failed)."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


# ---- configuration --------------------------------------------------------------------

def read_config(path: str) -> dict[str, str]:
    """crictl's YAML config (`runtime-endpoint: unix:///...` lines): flat keys only, so a
    small reader does; no YAML dependency."""
    values: dict[str, str] = {}
    with open(path) as f:
        for number, raw in enumerate(f, 1):
            line = raw.split(" #")[0].strip() if not raw.lstrip().startswith("#") else ""
            if not line or line == "---":
                continue
            key, sep, value = line.partition(":")
            if not sep or not key.strip():
                raise Fatal(f"load config file {path}: line {number}: expected `key: value`")
            value = value.strip()
            if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
                value = value[1:-1]
            values[key.strip()] = value
    return values


def parse_duration(text: str) -> float:
    """Seconds from a Go duration ("2s", "1m30s", "500ms") or a bare number of seconds."""
    text = str(text).strip()
    try:
        return float(text)
    except ValueError:
        pass
    units = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
    parts = re.findall(r"(\d+(?:\.\d*)?)(ns|us|µs|ms|s|m|h)", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise Fatal(f"invalid duration {text!r} (e.g. 2s, 500ms, 1m)")
    return sum(float(n) * units[u] for n, u in parts)


def _truthy(value: str) -> bool:
    return value.strip().lower() in ("1", "true", "yes", "on")


def resolve_settings(args: argparse.Namespace) -> tuple[str, str, float, bool]:
    """Endpoints, timeout and debug as crictl settles them: a flag (or its environment
    variable), else the config file, else the defaults."""
    config_path = args.config or os.environ.get("CRI_CONFIG_FILE") or ""
    config: dict[str, str] = {}
    if config_path:
        if not os.path.exists(config_path):
            raise Fatal(f"load config file {config_path}: no such file")
        config = read_config(config_path)
    elif os.path.exists(DEFAULT_CONFIG):
        config = read_config(DEFAULT_CONFIG)
    runtime = (args.runtime_endpoint or os.environ.get("CONTAINER_RUNTIME_ENDPOINT")
               or config.get("runtime-endpoint", ""))
    if not runtime:
        runtime = next((e for e in DEFAULT_ENDPOINTS if os.path.exists(e[len("unix://"):])),
                       DEFAULT_ENDPOINTS[0])
        print(f"WARN[0000] runtime connect using default endpoint: {runtime}",
              file=sys.stderr)
    image = (args.image_endpoint or os.environ.get("IMAGE_SERVICE_ENDPOINT")
             or config.get("image-endpoint", "") or runtime)
    timeout_text = args.global_timeout or config.get("timeout", "")
    timeout = parse_duration(timeout_text) if timeout_text else DEFAULT_TIMEOUT
    if timeout <= 0:
        timeout = DEFAULT_TIMEOUT
    debug = bool(args.debug) or _truthy(config.get("debug", "false"))
    return runtime, image, timeout, debug


# ---- output ---------------------------------------------------------------------------

def truncate_id(ident: str, prefix: str = "") -> str:
    """The 13-character ID crictl shows in tables (after an optional prefix like sha256:)."""
    if prefix and ident.startswith(prefix):
        ident = ident[len(prefix):]
    return ident[:13]


def human_duration(seconds: float) -> str:
    """docker/go-units HumanDuration, which crictl's CREATED column uses."""
    s = int(seconds)
    if s < 1:
        return "Less than a second"
    if s == 1:
        return "1 second"
    if s < 60:
        return f"{s} seconds"
    minutes, hours = s // 60, s // 3600
    if minutes == 1:
        return "About a minute"
    if minutes < 60:
        return f"{minutes} minutes"
    if hours == 1:
        return "About an hour"
    if hours < 48:
        return f"{hours} hours"
    if hours < 24 * 7 * 2:
        return f"{hours // 24} days"
    if hours < 24 * 30 * 2:
        return f"{hours // 24 // 7} weeks"
    if hours < 24 * 365 * 2:
        return f"{hours // 24 // 30} months"
    return f"{hours // 24 // 365} years"


def ago(created_ns: int) -> str:
    return human_duration(time.time() - created_ns / 1e9) + " ago"


def human_size(size: float) -> str:
    """docker/go-units HumanSize: decimal units, four significant digits."""
    units = ["B", "kB", "MB", "GB", "TB", "PB", "EB", "ZB", "YB"]
    i = 0
    while size >= 1000 and i < len(units) - 1:
        size /= 1000.0
        i += 1
    return f"{size:.4g}{units[i]}"


def table(header: list[str], rows: Iterable[list[str]]) -> str:
    """Columns as Go's tabwriter lays out crictl's tables (min width 20, padding 3)."""
    rows = [header, *rows]
    widths = [max(20, max(len(r[i]) for r in rows) + 3) for i in range(len(header) - 1)]
    lines = []
    for r in rows:
        cells = [c.ljust(w) for c, w in zip(r, widths)] + [r[-1]]
        lines.append("".join(cells).rstrip())
    return "\n".join(lines) + "\n"


def to_dict(msg: message.Message) -> dict:
    """Protobuf JSON as crictl prints it: camelCase names, fields at their defaults too,
    in the order the .proto declares them."""
    return _in_field_order(msg.DESCRIPTOR, json_format.MessageToDict(
        msg, always_print_fields_with_no_presence=True))


def _in_field_order(desc, value: Any) -> Any:
    if not isinstance(value, dict):
        return value
    out = {}
    for field in desc.fields:
        if field.json_name not in value:
            continue
        v = value[field.json_name]
        sub = field.message_type
        if sub is not None and sub.GetOptions().map_entry:
            value_field = sub.fields_by_name["value"]
            if value_field.message_type is not None:
                v = {k: _in_field_order(value_field.message_type, x) for k, x in v.items()}
        elif sub is not None and isinstance(v, list):
            v = [_in_field_order(sub, x) for x in v]
        elif sub is not None:
            v = _in_field_order(sub, v)
        out[field.json_name] = v
    out.update((k, v) for k, v in value.items() if k not in out)  # well-known types' keys
    return out


def status_info(status: message.Message, info: dict[str, str] | None = None) -> str:
    """crictl's inspect layout: {"status": ..., <each info key>: its value, parsed when it
    is JSON}."""
    out: dict[str, Any] = {"status": to_dict(status)}
    for key in sorted(info or {}):
        try:
            out[key] = json.loads(info[key])  # type: ignore[index]
        except ValueError:
            out[key] = info[key]  # type: ignore[index]
    return json.dumps(out, indent=2)


def write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


# ---- loading configs ------------------------------------------------------------------

def load_message(path: str, msg: message.Message) -> message.Message:
    """A CRI message from a JSON (or, with PyYAML, YAML) file, as crictl reads pod and
    container configs: snake_case or camelCase names, enums by name or number, unknown
    fields ignored."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError as exc:
        raise Fatal(f"load {path}: {exc.strerror}") from None
    try:
        data = json.loads(text)
    except ValueError as exc:
        try:
            import yaml  # type: ignore[import-untyped]
        except ImportError:
            raise Fatal(f"load {path}: not JSON ({exc}); YAML needs PyYAML") from None
        data = yaml.safe_load(text)
    try:
        return json_format.ParseDict(data, msg, ignore_unknown_fields=True)
    except json_format.ParseError as exc:
        raise Fatal(f"load {path}: not a {msg.DESCRIPTOR.name}: {exc}") from None


# ---- commands -------------------------------------------------------------------------

def cmd_version(c: CriClient, a: argparse.Namespace) -> None:
    r = c.runtime("Version", cri.VersionRequest(version=CLIENT_VERSION))
    write(f"Version:  {r.version}\nRuntimeName:  {r.runtime_name}\n"
          f"RuntimeVersion:  {r.runtime_version}\nRuntimeApiVersion:  {r.runtime_api_version}\n")


def cmd_info(c: CriClient, a: argparse.Namespace) -> None:
    r = c.runtime("Status", cri.StatusRequest(verbose=True))
    write(status_info(r.status, dict(r.info)) + "\n")


def cmd_runp(c: CriClient, a: argparse.Namespace) -> None:
    config = load_message(a.config_file, cri.PodSandboxConfig())
    try:
        r = c.runtime("RunPodSandbox", cri.RunPodSandboxRequest(
            config=config, runtime_handler=a.runtime or ""))
    except CriError as exc:
        raise Fatal(f"run pod sandbox: {exc}") from None
    write(r.pod_sandbox_id + "\n")


def cmd_create(c: CriClient, a: argparse.Namespace) -> None:
    container = load_message(a.container_config, cri.ContainerConfig())
    pod = load_message(a.pod_config, cri.PodSandboxConfig())
    try:
        r = c.runtime("CreateContainer", cri.CreateContainerRequest(
            pod_sandbox_id=a.pod_id, config=container, sandbox_config=pod))
    except CriError as exc:
        raise Fatal(f"creating container: {exc}") from None
    write(r.container_id + "\n")


def _each(ids: list[str], what: str, fn) -> None:
    """Run fn per ID; like crictl, report the first failure after trying all."""
    errors = []
    for ident in ids:
        try:
            fn(ident)
        except CriError as exc:
            errors.append(f"{what} {ident!r}: {exc}")
    if errors:
        raise Fatal("; ".join(errors))


def cmd_start(c: CriClient, a: argparse.Namespace) -> None:
    def start(ident: str) -> None:
        c.runtime("StartContainer", cri.StartContainerRequest(container_id=ident))
        write(ident + "\n")
    _each(a.ids, "starting the container", start)


def cmd_stop(c: CriClient, a: argparse.Namespace) -> None:
    def stop(ident: str) -> None:
        # The call lasts up to the grace period: give it that on top of the usual deadline.
        c.runtime("StopContainer", cri.StopContainerRequest(container_id=ident,
                                                            timeout=a.timeout),
                  timeout=(c.timeout or 0) + a.timeout)
        write(ident + "\n")
    _each(a.ids, "stopping the container", stop)


def cmd_rm(c: CriClient, a: argparse.Namespace) -> None:
    ids = list(a.ids)
    if a.all:
        ids = [x.id for x in c.runtime("ListContainers", cri.ListContainersRequest()).containers]
    if not ids:
        raise Fatal("ID cannot be empty")

    def rm(ident: str) -> None:
        status = c.runtime("ContainerStatus", cri.ContainerStatusRequest(container_id=ident))
        if status.status.state == cri.CONTAINER_RUNNING:
            if not a.force:
                raise CriError(grpc.StatusCode.FAILED_PRECONDITION,
                               "container is running, please stop it first or use -f")
            c.runtime("StopContainer", cri.StopContainerRequest(container_id=ident))
        c.runtime("RemoveContainer", cri.RemoveContainerRequest(container_id=ident))
        write(ident + "\n")
    _each(ids, "removing the container", rm)


def cmd_stopp(c: CriClient, a: argparse.Namespace) -> None:
    ids = list(a.ids)
    if a.all:
        ids = [p.id for p in c.runtime("ListPodSandbox", cri.ListPodSandboxRequest()).items]

    def stopp(ident: str) -> None:
        c.runtime("StopPodSandbox", cri.StopPodSandboxRequest(pod_sandbox_id=ident))
        write(f"Stopped sandbox {ident}\n")
    _each(ids, "stopping the pod sandbox", stopp)


def cmd_rmp(c: CriClient, a: argparse.Namespace) -> None:
    ids = list(a.ids)
    if a.all:
        ids = [p.id for p in c.runtime("ListPodSandbox", cri.ListPodSandboxRequest()).items]

    def rmp(ident: str) -> None:
        status = c.runtime("PodSandboxStatus", cri.PodSandboxStatusRequest(pod_sandbox_id=ident))
        if status.status.state == cri.SANDBOX_READY:
            if not a.force:
                raise CriError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"pod sandbox {ident} is running, please stop it first or "
                               "use -f")
            c.runtime("StopPodSandbox", cri.StopPodSandboxRequest(pod_sandbox_id=ident))
        c.runtime("RemovePodSandbox", cri.RemovePodSandboxRequest(pod_sandbox_id=ident))
        write(f"Removed sandbox {ident}\n")
    _each(ids, "removing the pod sandbox", rmp)


def cmd_exec(c: CriClient, a: argparse.Namespace) -> None:
    if a.interactive or a.tty:
        raise Fatal("exec -i/-t needs the streaming server: not supported by this client "
                    "(use -s, or the real crictl through $CRICTL)")
    if not a.cmd:
        raise Fatal("command cannot be empty")
    # No deadline unless the command has one; then the command's plus the connection's.
    deadline = None if a.timeout <= 0 else a.timeout + (c.timeout or 0)
    try:
        r = c.runtime("ExecSync", cri.ExecSyncRequest(container_id=a.container, cmd=a.cmd,
                                                     timeout=a.timeout), timeout=deadline)
    except CriError as exc:
        raise Fatal(f"execing command in container synchronously: {exc}") from None
    sys.stdout.buffer.write(r.stdout)
    sys.stdout.flush()
    sys.stderr.buffer.write(r.stderr)
    sys.stderr.flush()
    if r.exit_code != 0:
        raise ExitCode(r.exit_code)


def cmd_port_forward(c: CriClient, a: argparse.Namespace) -> None:
    """Listen on a local port and forward each connection to the pod's port, through
    the runtime's streaming server (testbed/portforward.py), until interrupted."""
    import asyncio
    import signal

    from . import portforward

    local, remote = portforward.parse_ports(a.ports)

    def url() -> str:
        return c.runtime("PortForward", cri.PortForwardRequest(pod_sandbox_id=a.pod,
                                                               port=[remote])).url

    try:
        url()  # a pod that cannot forward is refused before anything listens
    except CriError as exc:
        raise Fatal(f"port forward: {exc}") from None

    async def run() -> None:
        task = asyncio.ensure_future(portforward.forward(
            lambda: asyncio.to_thread(url), local, remote))
        for signum in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(signum, task.cancel)
        try:
            await task
        except asyncio.CancelledError:
            pass

    try:
        asyncio.run(run())
    except OSError as exc:
        raise Fatal(f"port forward: listen on 127.0.0.1:{local}: {exc.strerror}") from None


def cmd_inspect(c: CriClient, a: argparse.Namespace) -> None:
    for ident in a.ids:
        try:
            r = c.runtime("ContainerStatus", cri.ContainerStatusRequest(container_id=ident,
                                                                       verbose=True))
        except CriError as exc:
            raise Fatal(f"getting the status of the container {ident!r}: {exc}") from None
        write(status_info(r.status, dict(r.info)) + "\n")


def cmd_inspectp(c: CriClient, a: argparse.Namespace) -> None:
    for ident in a.ids:
        try:
            r = c.runtime("PodSandboxStatus", cri.PodSandboxStatusRequest(
                pod_sandbox_id=ident, verbose=True))
        except CriError as exc:
            raise Fatal(f"getting the pod sandbox status for {ident!r}: {exc}") from None
        write(status_info(r.status, dict(r.info)) + "\n")


def cmd_inspecti(c: CriClient, a: argparse.Namespace) -> None:
    for ref in a.images:
        r = c.image("ImageStatus", cri.ImageStatusRequest(image=cri.ImageSpec(image=ref),
                                                         verbose=True))
        if not r.HasField("image"):
            raise Fatal(f"no such image {ref!r} present")
        write(status_info(r.image, dict(r.info)) + "\n")


def _container_state(state: int) -> str:
    return {cri.CONTAINER_CREATED: "Created", cri.CONTAINER_RUNNING: "Running",
            cri.CONTAINER_EXITED: "Exited"}.get(state, "Unknown")


_STATES = {"created": cri.CONTAINER_CREATED, "running": cri.CONTAINER_RUNNING,
           "exited": cri.CONTAINER_EXITED, "unknown": cri.CONTAINER_UNKNOWN}


def cmd_ps(c: CriClient, a: argparse.Namespace) -> None:
    flt = cri.ContainerFilter(id=a.id or "", pod_sandbox_id=a.pod or "")
    if a.state:
        if a.state.lower() not in _STATES:
            raise Fatal(f"state should be one of {', '.join(_STATES)}")
        flt.state.state = _STATES[a.state.lower()]
    elif not a.all and not a.id:
        flt.state.state = cri.CONTAINER_RUNNING
    for sel in a.label or []:
        key, _, value = sel.partition("=")
        flt.label_selector[key] = value
    containers = list(c.runtime("ListContainers", cri.ListContainersRequest(filter=flt))
                      .containers)
    if a.name:
        containers = [x for x in containers if re.search(a.name, x.metadata.name)]
    containers.sort(key=lambda x: x.created_at, reverse=True)
    if a.latest:
        containers = containers[:1]
    if a.output == "json":
        write(json.dumps({"containers": [to_dict(x) for x in containers]}, indent=2) + "\n")
        return
    if a.quiet:
        write("".join(x.id + "\n" for x in containers))
        return
    pods = {p.id: p for p in c.runtime("ListPodSandbox", cri.ListPodSandboxRequest()).items}
    rows = []
    for x in containers:
        pod = pods.get(x.pod_sandbox_id)
        pod_name = x.labels.get("io.kubernetes.pod.name") or (pod.metadata.name if pod
                                                              else "unknown")
        image = x.image.image
        if image.startswith("sha256:"):
            image = truncate_id(image, "sha256:")
        rows.append([truncate_id(x.id), image, ago(x.created_at), _container_state(x.state),
                     x.metadata.name, str(x.metadata.attempt), truncate_id(x.pod_sandbox_id),
                     pod_name])
    write(table(["CONTAINER", "IMAGE", "CREATED", "STATE", "NAME", "ATTEMPT", "POD ID",
                 "POD"], rows))


def cmd_pods(c: CriClient, a: argparse.Namespace) -> None:
    flt = cri.PodSandboxFilter(id=a.id or "")
    if a.state:
        states = {"ready": cri.SANDBOX_READY, "notready": cri.SANDBOX_NOTREADY}
        if a.state.lower() not in states:
            raise Fatal("state should be ready or notready")
        flt.state.state = states[a.state.lower()]
    for sel in a.label or []:
        key, _, value = sel.partition("=")
        flt.label_selector[key] = value
    pods = list(c.runtime("ListPodSandbox", cri.ListPodSandboxRequest(filter=flt)).items)
    if a.name:
        pods = [p for p in pods if re.search(a.name, p.metadata.name)]
    if a.namespace:
        pods = [p for p in pods if re.search(a.namespace, p.metadata.namespace)]
    pods.sort(key=lambda p: p.created_at, reverse=True)
    if a.latest:
        pods = pods[:1]
    if a.output == "json":
        write(json.dumps({"items": [to_dict(p) for p in pods]}, indent=2) + "\n")
        return
    if a.quiet:
        write("".join(p.id + "\n" for p in pods))
        return
    rows = [[truncate_id(p.id), ago(p.created_at),
             "Ready" if p.state == cri.SANDBOX_READY else "NotReady", p.metadata.name,
             p.metadata.namespace, str(p.metadata.attempt), p.runtime_handler or "(default)"]
            for p in pods]
    write(table(["POD ID", "CREATED", "STATE", "NAME", "NAMESPACE", "ATTEMPT", "RUNTIME"],
                rows))


def _log_records(data: bytes) -> list[tuple[str, str, bytes]]:
    """(timestamp, stream, line) from a CRI log file: each file line is `TIMESTAMP STREAM
    TAG MESSAGE`, tag P (partial: continues in the next record) or F (full)."""
    records: list[tuple[str, str, bytes]] = []
    pending: dict[str, tuple[str, bytes]] = {}
    for raw in data.split(b"\n"):
        if not raw:
            continue
        parts = raw.split(b" ", 3)
        if len(parts) < 3:
            continue
        ts, stream, tag = (p.decode(errors="replace") for p in parts[:3])
        msg = parts[3] if len(parts) == 4 else b""
        first_ts, so_far = pending.pop(stream, (ts, b""))
        if "P" in tag.split(":"):
            pending[stream] = (first_ts, so_far + msg)
            continue
        records.append((first_ts, stream, so_far + msg + b"\n"))
    for stream, (ts, msg) in pending.items():  # a partial line still being written
        records.append((ts, stream, msg))
    return records


def _emit(records: list[tuple[str, str, bytes]], timestamps: bool) -> None:
    for ts, stream, line in records:
        out = sys.stderr if stream == "stderr" else sys.stdout
        out.buffer.write((ts.encode() + b" " if timestamps else b"") + line)
        out.flush()


def cmd_logs(c: CriClient, a: argparse.Namespace) -> None:
    try:
        r = c.runtime("ContainerStatus", cri.ContainerStatusRequest(container_id=a.container))
    except CriError as exc:
        raise Fatal(f"getting the status of the container {a.container!r}: {exc}") from None
    path = r.status.log_path
    if not path:
        raise Fatal(f"the container {a.container!r} has no log path (the pod config sets "
                    "no log_directory, or the container config no log_path)")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise Fatal(f"read log file {path}: {exc.strerror}") from None
    complete = data[: data.rfind(b"\n") + 1] if a.follow else data
    records = _log_records(complete)
    if a.tail is not None and a.tail >= 0:
        records = records[len(records) - a.tail:] if a.tail else []
    _emit(records, a.timestamps)
    if not a.follow:
        return
    offset = len(complete)
    while True:  # until the container has stopped and its log has been read to the end
        time.sleep(0.2)
        running = c.runtime("ContainerStatus", cri.ContainerStatusRequest(
            container_id=a.container)).status.state == cri.CONTAINER_RUNNING
        with open(path, "rb") as f:
            f.seek(offset)
            more = f.read()
        if not running:
            _emit(_log_records(more), a.timestamps)
            return
        more = more[: more.rfind(b"\n") + 1]
        offset += len(more)
        _emit(_log_records(more), a.timestamps)


def _stats(c: CriClient, a: argparse.Namespace) -> list[cri.ContainerStats]:
    flt = cri.ContainerStatsFilter(id=a.id or "", pod_sandbox_id=a.pod or "")
    stats = list(c.runtime("ListContainerStats",
                           cri.ListContainerStatsRequest(filter=flt)).stats)
    if not a.all:
        running = {x.id for x in c.runtime("ListContainers", cri.ListContainersRequest(
            filter=cri.ContainerFilter(state=cri.ContainerStateValue(
                state=cri.CONTAINER_RUNNING)))).containers}
        stats = [s for s in stats if s.attributes.id in running]
    return stats


def cmd_stats(c: CriClient, a: argparse.Namespace) -> None:
    a.id = a.id or a.container
    first = _stats(c, a)
    if a.output == "json":
        write(json.dumps({"stats": [to_dict(s) for s in first]}, indent=2) + "\n")
        return
    before = {s.attributes.id: s for s in first}
    time.sleep(a.seconds)
    rows = []
    for s in sorted(_stats(c, a), key=lambda s: s.attributes.metadata.name):
        old = before.get(s.attributes.id)
        cpu = 0.0
        if old is not None and s.cpu.timestamp > old.cpu.timestamp:
            used = s.cpu.usage_core_nano_seconds.value - old.cpu.usage_core_nano_seconds.value
            cpu = used / (s.cpu.timestamp - old.cpu.timestamp) * 100
        rows.append([truncate_id(s.attributes.id), s.attributes.metadata.name, f"{cpu:.2f}",
                     human_size(s.memory.working_set_bytes.value),
                     human_size(s.writable_layer.used_bytes.value),
                     str(s.writable_layer.inodes_used.value)])
    write(table(["CONTAINER", "NAME", "CPU %", "MEM", "DISK", "INODES"], rows))


def cmd_update(c: CriClient, a: argparse.Namespace) -> None:
    res = cri.LinuxContainerResources(
        cpu_period=a.cpu_period, cpu_quota=a.cpu_quota, cpu_shares=a.cpu_share,
        memory_limit_in_bytes=a.memory, cpuset_cpus=a.cpuset_cpus, cpuset_mems=a.cpuset_mems)

    def update(ident: str) -> None:
        c.runtime("UpdateContainerResources", cri.UpdateContainerResourcesRequest(
            container_id=ident, linux=res))
        write(ident + "\n")
    _each(a.ids, "updating container resources for", update)


def cmd_images(c: CriClient, a: argparse.Namespace) -> None:
    flt = cri.ImageFilter(image=cri.ImageSpec(image=a.image or ""))
    images = list(c.image("ListImages", cri.ListImagesRequest(filter=flt)).images)
    if a.output == "json":
        write(json.dumps({"images": [to_dict(i) for i in images]}, indent=2) + "\n")
        return
    if a.quiet:
        write("".join(i.id + "\n" for i in images))
        return
    rows = []
    for i in images:
        for tag in i.repo_tags or ["<none>:<none>"]:
            repo, _, version = tag.rpartition(":")
            rows.append([repo, version, truncate_id(i.id, "sha256:"), human_size(i.size)])
    write(table(["IMAGE", "TAG", "IMAGE ID", "SIZE"], rows))


def cmd_pull(c: CriClient, a: argparse.Namespace) -> None:
    try:
        r = c.image("PullImage", cri.PullImageRequest(image=cri.ImageSpec(image=a.image)),
                    timeout=None)
    except CriError as exc:
        raise Fatal(f"pulling image: {exc}") from None
    write(f"Image is up to date for {r.image_ref}\n")


# ---- command line ---------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="crictl", description="crictl-compatible CRI client (podvm tests)",
        epilog="Environment: CONTAINER_RUNTIME_ENDPOINT, IMAGE_SERVICE_ENDPOINT, "
               "CRI_CONFIG_FILE.")
    p.add_argument("-r", "--runtime-endpoint", metavar="ENDPOINT",
                   help="CRI runtime endpoint, unix:///path")
    p.add_argument("-i", "--image-endpoint", metavar="ENDPOINT",
                   help="CRI image endpoint (default: the runtime's)")
    # dest: `stop -t` and `exec --timeout` have their own
    p.add_argument("-t", "--timeout", dest="global_timeout", metavar="DURATION",
                   help="deadline of each call, e.g. 2s (default 2s)")
    p.add_argument("-c", "--config", metavar="FILE",
                   help=f"crictl config file (default {DEFAULT_CONFIG})")
    p.add_argument("-D", "--debug", action="store_true", help="print requests and responses")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def cmd(name: str, fn, help: str) -> argparse.ArgumentParser:
        s = sub.add_parser(name, help=help, description=help)
        s.set_defaults(fn=fn)
        return s

    cmd("version", cmd_version, "runtime version")
    cmd("info", cmd_info, "runtime status and configuration (JSON)")
    s = cmd("runp", cmd_runp, "run a pod sandbox from a PodSandboxConfig file")
    s.add_argument("-r", "--runtime", help="runtime handler (RuntimeClass handler)")
    s.add_argument("config_file", metavar="pod-config.json")
    s = cmd("create", cmd_create, "create a container in a pod")
    s.add_argument("--no-pull", action="store_true", help="accepted; never pulls anyway")
    s.add_argument("pod_id", metavar="POD-ID")
    s.add_argument("container_config", metavar="container-config.json")
    s.add_argument("pod_config", metavar="pod-config.json")
    s = cmd("start", cmd_start, "start created containers")
    s.add_argument("ids", nargs="+", metavar="ID")
    s = cmd("stop", cmd_stop, "stop running containers")
    s.add_argument("-t", "--timeout", type=int, default=0, help="grace period, seconds")
    s.add_argument("ids", nargs="+", metavar="ID")
    s = cmd("rm", cmd_rm, "remove containers")
    s.add_argument("-f", "--force", action="store_true", help="stop a running one first")
    s.add_argument("-a", "--all", action="store_true", help="every container")
    s.add_argument("ids", nargs="*", metavar="ID")
    s = cmd("stopp", cmd_stopp, "stop pod sandboxes")
    s.add_argument("-a", "--all", action="store_true", help="every pod")
    s.add_argument("ids", nargs="*", metavar="ID")
    s = cmd("rmp", cmd_rmp, "remove pod sandboxes")
    s.add_argument("-f", "--force", action="store_true", help="stop a ready one first")
    s.add_argument("-a", "--all", action="store_true", help="every pod")
    s.add_argument("ids", nargs="*", metavar="ID")
    s = cmd("exec", cmd_exec, "run a command in a container (ExecSync)")
    s.add_argument("-s", "--sync", action="store_true", help="synchronously (always)")
    s.add_argument("--timeout", type=int, default=0, help="command's limit, seconds")
    s.add_argument("-i", "--interactive", action="store_true", help="not supported")
    s.add_argument("-t", "--tty", action="store_true", help="not supported")
    s.add_argument("container", metavar="ID")
    s.add_argument("cmd", nargs=argparse.REMAINDER, metavar="CMD")
    s = cmd("port-forward", cmd_port_forward, "forward a local port to a pod's port")
    s.add_argument("pod", metavar="POD-ID")
    s.add_argument("ports", metavar="[LOCAL_PORT:]REMOTE_PORT")
    s = cmd("logs", cmd_logs, "print a container's log")
    s.add_argument("--tail", type=int, help="only the last N lines")
    s.add_argument("-t", "--timestamps", action="store_true", help="show timestamps")
    s.add_argument("-f", "--follow", action="store_true", help="until the container stops")
    s.add_argument("container", metavar="ID")
    s = cmd("ps", cmd_ps, "list containers")
    s.add_argument("-a", "--all", action="store_true", help="not only running ones")
    s.add_argument("-q", "--quiet", action="store_true", help="only IDs")
    s.add_argument("-p", "--pod", help="only this pod's")
    s.add_argument("--id", help="only this container")
    s.add_argument("--name", help="name regular expression")
    s.add_argument("--state", help="created, running, exited or unknown")
    s.add_argument("--label", action="append", help="key=value")
    s.add_argument("-l", "--latest", action="store_true", help="only the newest")
    s.add_argument("-o", "--output", choices=("table", "json"), default="table")
    s = cmd("pods", cmd_pods, "list pod sandboxes")
    s.add_argument("-q", "--quiet", action="store_true", help="only IDs")
    s.add_argument("--id", help="only this pod")
    s.add_argument("--name", help="name regular expression")
    s.add_argument("--namespace", help="namespace regular expression")
    s.add_argument("--state", help="ready or notready")
    s.add_argument("--label", action="append", help="key=value")
    s.add_argument("-l", "--latest", action="store_true", help="only the newest")
    s.add_argument("-o", "--output", choices=("table", "json"), default="table")
    for name, fn, what in (("inspect", cmd_inspect, "container"),
                           ("inspectp", cmd_inspectp, "pod sandbox")):
        s = cmd(name, fn, f"{what} status and info (JSON)")
        s.add_argument("-o", "--output", choices=("json",), default="json")
        s.add_argument("ids", nargs="+", metavar="ID")
    s = cmd("inspecti", cmd_inspecti, "image status and info (JSON)")
    s.add_argument("-o", "--output", choices=("json",), default="json")
    s.add_argument("images", nargs="+", metavar="IMAGE")
    s = cmd("stats", cmd_stats, "container resource usage")
    s.add_argument("-a", "--all", action="store_true", help="not only running ones")
    s.add_argument("--id", help="only this container")
    s.add_argument("-p", "--pod", help="only this pod's")
    s.add_argument("-s", "--seconds", type=float, default=1, help="sample interval")
    s.add_argument("-o", "--output", choices=("table", "json"), default="table")
    s.add_argument("container", nargs="?", metavar="ID")
    s = cmd("update", cmd_update, "update containers' resources")
    s.add_argument("--cpu-period", type=int, default=0)
    s.add_argument("--cpu-quota", type=int, default=0)
    s.add_argument("--cpu-share", type=int, default=0)
    s.add_argument("--memory", type=int, default=0, help="bytes")
    s.add_argument("--cpuset-cpus", default="")
    s.add_argument("--cpuset-mems", default="")
    s.add_argument("ids", nargs="+", metavar="ID")
    s = cmd("images", cmd_images, "list images")
    s.add_argument("-q", "--quiet", action="store_true", help="only IDs")
    s.add_argument("-o", "--output", choices=("table", "json"), default="table")
    s.add_argument("image", nargs="?")
    s = cmd("pull", cmd_pull, "pull an image")
    s.add_argument("image")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        runtime, image, timeout, debug = resolve_settings(args)
        with CriClient(runtime, image, timeout, sys.stderr if debug else None) as client:
            args.fn(client, args)
    except ExitCode as exc:
        return exc.code
    except (Fatal, CriError, ValueError) as exc:
        print(f"FATA[0000] {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
