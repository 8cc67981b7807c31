"""ttrpc and shim process figures: unary round trips (sequential and pipelined) against a
real shim daemon, the error path (State of an unknown id) and the log it writes, the wall
time of `start`, how soon the daemon answers its first Connect (and then a State, which
needs the Task service's code, as a Create does), and the RSS of an idle daemon (one that
has served both).

Targets (issue: foundation), measured against on these machines: idle daemon RSS <= 22 MB
(Kata's Go shim 39 MB, runc's shim 9-11 MB); `start` median <= 50 ms (Kata 64 ms, runc
17 ms); pipelined calls within 3x of Go ttrpc (about 22 us per call, so <= 66 us).
Readiness: the first Connect answered <= 60 ms after `start` began (runc's shim 9-11 ms;
containerd connects as soon as `start` has printed the address). Errors: State of an
unknown id within 1.5x of Connect (Go shim: 54 vs 47 us), logged at debug only.

Each `start` runs as containerd runs it: the environment it sets, a `<bundle>/log` FIFO that
is open for reading before `start` runs (and drained, as containerd copies it to its log).

usage: python bench/ttrpc_bench.py [--calls N] [--starts N] [--errors N] [--json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import select
import socket
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from podvm_core.pb.containerd.task.v2 import shim_pb2 as api  # noqa: E402
from podvm_core.pb.ttrpc_pb2 import Request, Response  # noqa: E402
from podvm_core.ttrpc import Client, Code, TtrpcError, framing  # noqa: E402
from testbed.shimproc import daemon_pid, make_bundle, run_shim  # noqa: E402

NS = "podvm-bench"
TASK = "containerd.task.v2.Task"


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]


async def round_trips(address: str, calls: int) -> dict:
    request = api.ConnectRequest(id="bench")
    async with await Client.connect(address) as client:
        for _ in range(200):  # warm up
            await client.call(TASK, "Connect", request, api.ConnectResponse)
        latencies = []
        begin = time.perf_counter()
        for _ in range(calls):
            t = time.perf_counter()
            await client.call(TASK, "Connect", request, api.ConnectResponse)
            latencies.append(time.perf_counter() - t)
        sequential = time.perf_counter() - begin
        window = 64
        begin = time.perf_counter()
        done = 0
        while done < calls:
            batch = min(window, calls - done)
            await asyncio.gather(*(client.call(TASK, "Connect", request, api.ConnectResponse)
                                   for _ in range(batch)))
            done += batch
        pipelined = time.perf_counter() - begin
    return {
        "unary_p50_us": percentile(latencies, 50) * 1e6,
        "unary_p99_us": percentile(latencies, 99) * 1e6,
        "sequential_calls_per_s": calls / sequential,
        "pipelined64_calls_per_s": calls / pipelined,
        "pipelined64_us_per_call": pipelined / calls * 1e6,
    }


async def error_path(address: str, calls: int) -> dict:
    """State of an id the daemon does not know (containerd polls ids it has deleted),
    interleaved call by call with Connect so that both see the same machine load."""
    connect = api.ConnectRequest(id="bench")
    unknown = api.StateRequest(id="no-such-container")
    async with await Client.connect(address) as client:
        async def state_unknown() -> None:
            try:
                await client.call(TASK, "State", unknown, api.StateResponse)
            except TtrpcError as err:
                if err.code != Code.NOT_FOUND:
                    raise
            else:
                raise SystemExit("State of an unknown id did not fail")

        async def call_connect() -> None:
            await client.call(TASK, "Connect", connect, api.ConnectResponse)

        for _ in range(200):  # warm up
            await call_connect()
            await state_unknown()
        latencies: dict[str, list[float]] = {"connect": [], "error": []}
        for _ in range(calls):
            for name, call in (("connect", call_connect), ("error", state_unknown)):
                t = time.perf_counter()
                await call()
                latencies[name].append(time.perf_counter() - t)
    return {
        "interleaved_connect_p50_us": percentile(latencies["connect"], 50) * 1e6,
        "interleaved_connect_p99_us": percentile(latencies["connect"], 99) * 1e6,
        "error_p50_us": percentile(latencies["error"], 50) * 1e6,
        "error_p99_us": percentile(latencies["error"], 99) * 1e6,
        "error_calls": calls + 200,
    }


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


def containerd_env(grpc: str, namespace: str) -> dict:
    """The environment containerd gives `start` (docs/design.md, The process contract). Without
    PYTHONDONTWRITEBYTECODE, which containerd does not set: an installed shim has its
    bytecode compiled, and compiling every module on every `start` is not what pods see."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    return {**env, "TTRPC_ADDRESS": grpc + ".ttrpc", "GRPC_ADDRESS": grpc,
            "NAMESPACE": namespace, "MAX_SHIM_VERSION": "2"}


def first_calls(address: str, begun: float, timeout: float = 10) -> tuple[float, float]:
    """Connect, then State of an unknown id, on a fresh connection, as containerd calls
    right after `start`: blocking calls only, so the figures are the daemon's and not this
    process's. Returns when each was answered (perf_counter seconds since `begun`): the
    daemon answers Connect without its Task service's code, which a State (and a Create)
    needs, so the second figure is when it serves a pod's first real call."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(address.removeprefix("unix://"))
        connect = _call(sock, 1, "Connect", api.ConnectRequest(id="bench"))
        if connect.status.code != Code.OK:
            raise SystemExit(f"Connect failed: {connect.status.message}")
        connected = time.perf_counter() - begun
        state = _call(sock, 3, "State", api.StateRequest(id="no-such-container"))
        if state.status.code != Code.NOT_FOUND:
            raise SystemExit(f"State of an unknown id answered {state.status}")
        return connected, time.perf_counter() - begun


def _call(sock: socket.socket, stream_id: int, method: str, message) -> Response:
    request = Request(service=TASK, method=method, payload=message.SerializeToString())
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


def rss_mb(pid: int) -> float:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--starts", type=int, default=30)
    parser.add_argument("--errors", type=int, default=20000,
                        help="State calls for an unknown id (each next to a Connect)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="podvm-bench-") as tmp:
        root = pathlib.Path(tmp)
        grpc = str(root / "containerd.sock")
        env = containerd_env(grpc, NS)
        for i in range(2):  # not measured: the first runs compile what changed since the last
            bundle = make_bundle(root, f"warm{i}", sandbox_id=f"warm{i}")
            log = LogFifo(bundle)
            first_calls(run_shim(bundle, f"warm{i}", "start", grpc, namespace=NS,
                                 env=env).stdout.decode(), time.perf_counter())
            run_shim(bundle, f"warm{i}", "delete", grpc, namespace=NS, env=env)
            log.close()
        start_ms, connect_ms, state_ms = [], [], []
        for i in range(args.starts):
            bundle = make_bundle(root, f"s{i}", sandbox_id=f"s{i}")
            log = LogFifo(bundle)
            t = time.perf_counter()
            result = run_shim(bundle, f"s{i}", "start", grpc, namespace=NS, env=env)
            start_ms.append((time.perf_counter() - t) * 1e3)
            if result.returncode != 0:
                raise SystemExit(result.stderr.decode())
            connected, stated = first_calls(result.stdout.decode(), t)
            connect_ms.append(connected * 1e3)
            state_ms.append(stated * 1e3)
            if i == 0:
                kept_log = log  # s0's daemon stays for the calls below
            else:
                run_shim(bundle, f"s{i}", "delete", grpc, namespace=NS, env=env)
                log.close()
        bundle = root / "s0"
        address = (bundle / "address").read_text()
        pid = daemon_pid(NS, "s0")
        time.sleep(1.0)
        idle_rss = rss_mb(pid)
        figures = asyncio.run(round_trips(address, args.calls))
        logged = kept_log.written()
        figures.update(asyncio.run(error_path(address, args.errors)))
        figures["log_bytes_per_error"] = (kept_log.written() - logged) / figures["error_calls"]
        figures.update({
            "start_median_ms": statistics.median(start_ms),
            "start_p90_ms": percentile(start_ms, 90),
            "first_connect_median_ms": statistics.median(connect_ms),
            "first_connect_max_ms": max(connect_ms),
            "first_state_median_ms": statistics.median(state_ms),
            "idle_daemon_rss_mb": idle_rss,
            "daemon_rss_after_calls_mb": rss_mb(pid),
        })
        run_shim(bundle, "s0", "delete", grpc, namespace=NS, env=env)
        kept_log.close()

    if args.json:
        print(json.dumps(figures, indent=2))
        return 0
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, {args.calls} calls, "
          f"{args.starts} starts, {args.errors} errors")
    error_ratio = figures["error_p50_us"] / figures["interleaved_connect_p50_us"]
    rows = [
        ("unary round trip p50", f"{figures['unary_p50_us']:.1f} us", ""),
        ("unary round trip p99", f"{figures['unary_p99_us']:.1f} us", ""),
        ("sequential calls/s", f"{figures['sequential_calls_per_s']:.0f}", ""),
        ("pipelined (64) calls/s", f"{figures['pipelined64_calls_per_s']:.0f}", ""),
        ("pipelined (64) per call", f"{figures['pipelined64_us_per_call']:.1f} us",
         "target <= 66 us (3x Go ttrpc)"),
        ("Connect p50 (interleaved)", f"{figures['interleaved_connect_p50_us']:.1f} us", ""),
        ("Connect p99 (interleaved)", f"{figures['interleaved_connect_p99_us']:.1f} us", ""),
        ("State unknown id p50", f"{figures['error_p50_us']:.1f} us",
         f"{error_ratio:.2f}x Connect, target <= 1.5x"),
        ("State unknown id p99", f"{figures['error_p99_us']:.1f} us", ""),
        ("log bytes per error reply", f"{figures['log_bytes_per_error']:.1f} B",
         "target 0 (debug only)"),
        ("start median", f"{figures['start_median_ms']:.1f} ms", "target <= 50 ms"),
        ("start p90", f"{figures['start_p90_ms']:.1f} ms", ""),
        ("first Connect after start, median", f"{figures['first_connect_median_ms']:.1f} ms",
         "target <= 60 ms (from just before `start` is spawned)"),
        ("first Connect after start, max", f"{figures['first_connect_max_ms']:.1f} ms", ""),
        ("State after that Connect, median", f"{figures['first_state_median_ms']:.1f} ms",
         "when a pod's first real call is served (Task service loaded)"),
        ("idle daemon RSS", f"{figures['idle_daemon_rss_mb']:.1f} MB", "target <= 22 MB"),
        ("daemon RSS after the calls", f"{figures['daemon_rss_after_calls_mb']:.1f} MB", ""),
    ]
    for name, value, target in rows:
        print(f"{name:34s} {value:>10s}   {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
