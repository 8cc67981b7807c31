"""One shim `start` measured as containerd runs it, podvm's or containerd's Go runc
shim's: the wall time of `start`, when its daemon answers the first Connect and then a
State of an unknown id (which needs podvm's Task service, as a Create does), and the CPU
both processes spent until then. bench/ttrpc_bench.py runs them side by side.

The CPU: `start`'s own (user + system, from wait4) and its daemon's when the State is
answered (/proc/<pid>/schedstat): less moved by other load than wall time, which on a
busy machine is mostly waiting for a CPU."""
from __future__ import annotations

import json
import os
import pathlib
import re
import select
import signal
import socket
import subprocess
import threading
import time
from typing import NamedTuple

from podvm_core.pb.containerd.task.v2 import shim_pb2 as api
from podvm_core.pb.ttrpc_pb2 import Request, Response
from podvm_core.ttrpc import Code, framing
from shim.host.paths import STATE_ROOT
from testbed.shimproc import make_bundle

NS = "podvm-bench"
TASK = "containerd.task.v2.Task"
GO_SHIM = "/root/.cache/verify/bin/containerd-shim-runc-v2"
"""containerd 2.3.4's runc shim, as ../shared/tools/build-verify-tools.sh builds it."""
GO_TASK = "containerd.task.v3.Task"
"""The Task API containerd 2.x's runc shim serves (its BootstrapResult says version 3)."""


class Start(NamedTuple):
    """ms from just before `start` is spawned; CPU in ms."""
    start: float
    connect: float
    state: float
    start_cpu: float
    daemon_cpu: float
    pid: int
    address: str
    server: int
    """The fork server that forked the daemon (shim.json), 0 where `start` forked it."""


def measure_start(shim: str, root: pathlib.Path, ident: str, grpc: str, env: dict,
                  go: bool = False) -> tuple[Start, pathlib.Path, "LogFifo"]:
    """`start` of a new sandbox `ident` with `shim`, then its first calls. `go`: the Go
    runc shim (Task API v3; nothing listens on its TTRPC_ADDRESS, which it dials only to
    publish an event). The caller ends the daemon (end_start) and closes the log."""
    bundle = make_bundle(root, ident, sandbox_id=ident)
    log = LogFifo(bundle)
    argv = [shim, "-namespace", NS, "-address", grpc, "-publish-binary",
            "/usr/bin/containerd", "-id", ident, "start"]
    t = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=bundle, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = proc.stdout.read(), proc.stderr.read()  # type: ignore[union-attr]
    _, status, usage = os.wait4(proc.pid, 0)
    started = time.perf_counter() - t
    proc.returncode = os.waitstatus_to_exitcode(status)
    found = re.search(rb"unix://[\x21-\x7e]+", out)
    if proc.returncode != 0 or not found:
        raise SystemExit(f"{shim} start failed: {out!r} {err.decode()[-2000:]}")
    address = found.group().decode()
    connected, stated, pid = first_calls(address, t, service=GO_TASK if go else TASK)
    server = 0 if go else forked_by(ident)
    return Start(started * 1e3, connected * 1e3, stated * 1e3,
                 (usage.ru_utime + usage.ru_stime) * 1e3, daemon_cpu_ms(pid), pid,
                 address, server), bundle, log


def forked_by(ident: str) -> int:
    """The fork server that forked the pod's daemon, as `start` recorded it (0: none)."""
    state = json.loads(pathlib.Path(f"{STATE_ROOT}/{NS}/{ident}/shim.json").read_text())
    return state.get("forkserver", 0)


def memory_mb(pid: int) -> tuple[float, float]:
    """(RSS, PSS) in MB: PSS shares each page among the processes that map it, so a
    daemon forked from the fork server counts only its part of what they share."""
    found = {}
    for line in pathlib.Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("Rss", "Pss"):
            found[key] = int(value.split()[0]) / 1024
    return found["Rss"], found["Pss"]


def end_start(shim: str, figures: Start, bundle: pathlib.Path, grpc: str, env: dict,
              go: bool = False) -> None:
    """podvm's daemon through its `delete`; the Go shim's killed, its socket removed."""
    if go:
        os.kill(figures.pid, signal.SIGKILL)
        os.unlink(figures.address.removeprefix("unix://"))
        return
    subprocess.run([shim, "-namespace", NS, "-address", grpc, "-publish-binary",
                    "/usr/bin/containerd", "-id", bundle.name, "delete"], cwd=bundle,
                   env=env, capture_output=True, timeout=10, stdin=subprocess.DEVNULL)


def daemon_cpu_ms(pid: int) -> float:
    with open(f"/proc/{pid}/schedstat") as f:
        return int(f.read().split()[0]) / 1e6


def containerd_env(grpc: str, namespace: str) -> dict:
    """The environment containerd gives `start` (docs/design.md, The process contract). Without
    PYTHONDONTWRITEBYTECODE, which containerd does not set: an installed shim has its
    bytecode compiled, and compiling every module on every `start` is not what pods see."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    return {**env, "TTRPC_ADDRESS": grpc + ".ttrpc", "GRPC_ADDRESS": grpc,
            "NAMESPACE": namespace, "MAX_SHIM_VERSION": "2"}


def first_calls(address: str, begun: float, timeout: float = 10,
                service: str = TASK) -> tuple[float, float, int]:
    """Connect, then State of an unknown id, on a fresh connection, as containerd calls
    right after `start`: blocking calls only, so the figures are the daemon's and not this
    process's. Returns when each was answered (perf_counter seconds since `begun`) and the
    shim's pid: the daemon answers Connect without its Task service's code, which a State
    (and a Create) needs, so the second figure is when it serves a pod's first real call."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(address.removeprefix("unix://"))
        connect = _call(sock, 1, service, "Connect", api.ConnectRequest(id="bench"))
        if connect.status.code != Code.OK:
            raise SystemExit(f"Connect failed: {connect.status.message}")
        connected = time.perf_counter() - begun
        state = _call(sock, 3, service, "State", api.StateRequest(id="no-such-container"))
        if state.status.code != Code.NOT_FOUND:
            raise SystemExit(f"State of an unknown id answered {state.status}")
        shim_pid = api.ConnectResponse.FromString(connect.payload).shim_pid
        return connected, time.perf_counter() - begun, shim_pid


def _call(sock: socket.socket, stream_id: int, service: str, method: str,
          message) -> Response:
    request = Request(service=service, method=method, payload=message.SerializeToString())
    sock.sendall(framing.encode(stream_id, framing.MessageType.REQUEST,
                                request.SerializeToString()))
    length = framing.HEADER.unpack(_receive(sock, framing.HEADER_SIZE))[0]
    return Response.FromString(_receive(sock, length))


def _receive(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise SystemExit("the daemon closed the connection before answering Connect")
        data += chunk
    return data


class LogFifo:
    """`<bundle>/log` as containerd makes it: a FIFO opened (read-write, so the shim never
    sees it without a reader) before `start` runs, drained all along; counts the bytes."""

    def __init__(self, bundle: pathlib.Path) -> None:
        os.mkfifo(bundle / "log")
        self._fd = os.open(bundle / "log", os.O_RDWR | os.O_NONBLOCK)
        self._lock = threading.Lock()
        self._bytes = 0
        self._stop = False
        self._thread = threading.Thread(target=self._drain, daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        while not self._stop:
            if select.select([self._fd], [], [], 0.05)[0]:
                try:
                    chunk = os.read(self._fd, 1 << 16)
                except BlockingIOError:
                    continue
                with self._lock:
                    self._bytes += len(chunk)

    def written(self, settle: float = 0.3) -> int:
        """Bytes the shim has written so far (after `settle` seconds for what is in flight)."""
        time.sleep(settle)
        with self._lock:
            return self._bytes

    def close(self) -> None:
        self._stop = True
        self._thread.join()
        os.close(self._fd)


