"""What crictl reads out of a container or a pod: a command's output (exec, through
ExecSync), its log (logs, from the CRI log file) and a port (port-forward, through the
streaming server: testbed/portforward.py)."""
from __future__ import annotations

import argparse
import time

from podvm_core.pb.cri import api_pb2 as cri

from .criclient import CriClient, CriError
from .crictlformat import ExitCode, Fatal, stderr, stdout


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
    stdout().buffer.write(r.stdout)
    stdout().flush()
    stderr().buffer.write(r.stderr)
    stderr().flush()
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
        out = stderr() if stream == "stderr" else stdout()
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
