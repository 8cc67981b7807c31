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

Issue 47: the first Connect at most 4x containerd 2.3.4's Go runc shim's, measured in the
same run, start by start alternated with podvm's (its Task API is containerd.task.v3).

podvm's `start` gets its daemon from the fork server (shim/contract/forkserver.py) once one
runs, as on a node in steady state: the figures of podvm's starts are those, and the bench
checks that each was served so. The first start on a node (or after an upgrade or the
server's idle exit) has none yet: forks its daemon itself and spawns the server; measured
apart (--cold, each after the server is stopped). The bench's fork servers live in a
directory of its own (PODVM_TEST_FORKSERVER_DIR) and are stopped at its end.

Each `start` runs as containerd runs it: the environment it sets, a `<bundle>/log` FIFO that
is open for reading before `start` runs (and drained, as containerd copies it to its log).

usage: python bench/ttrpc_bench.py [--calls N] [--starts N] [--cold N] [--errors N]
                                   [--go PATH] [--also LABEL=PATH ...] [--json]
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import pathlib
import signal
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench.shimstart import (GO_SHIM, NS, TASK, Start, containerd_env,  # noqa: E402
                             daemon_cpu_ms, end_start, measure_start, memory_mb)
from podvm_core.pb.containerd.task.v2 import shim_pb2 as api  # noqa: E402
from podvm_core.ttrpc import Client, Code, TtrpcError  # noqa: E402
from shim.contract import forkclient, identity  # noqa: E402
from shim.host.paths import STATE_ROOT  # noqa: E402
from testbed.shimproc import PARENT, SHIM, WORKER, processes  # noqa: E402


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


def rss_mb(pid: int) -> float:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def measure(args, shims: dict, root: pathlib.Path, grpc: str, env: dict, servers: str,
            code: str) -> dict:
    def one(label: str, ident: str) -> tuple[Start, pathlib.Path, object]:
        return measure_start(shims[label], root, ident, grpc, env, go=label == "go-runc")

    def end(label: str, figures: Start, bundle: pathlib.Path, log) -> None:
        end_start(shims[label], figures, bundle, grpc, env, go=label == "go-runc")
        log.close()

    cold: list[Start] = []
    for i in range(args.cold):  # the first start on a node: no fork server yet
        stop_server(servers, code)
        figures, bundle, log = one("podvm", f"cold{i}")
        cold.append(figures)
        end("podvm", figures, bundle, log)
        wait_server(servers, code)  # the one it spawned: stopped before the next
    for label in shims:  # not measured: the first runs compile, the fork server comes up
        for i in range(2):
            end(label, *one(label, f"{label}-warm{i}"))
    server = wait_server(servers, code)
    server_cpu = daemon_cpu_ms(server)
    starts: dict[str, list[Start]] = {label: [] for label in shims}
    kept: dict[str, tuple] = {}
    for i in range(args.starts):  # alternated, so that all see the same load
        for label in shims:
            figures, bundle, log = one(label, f"{label}{i}")
            starts[label].append(figures)
            if i == 0 and label != "go-runc":
                kept[label] = (figures, bundle, log)  # idle daemons, and the calls below
                continue
            end(label, figures, bundle, log)
    time.sleep(1.0)
    memory = {label: memory_mb(k[0].pid) for label, k in kept.items()}
    memory["fork server"] = memory_mb(server)
    for pid, _ in processes(WORKER, PARENT, parent=server):  # forks the pods' workers
        memory["its worker parent"] = memory_mb(pid)
    podvm, podvm_bundle, podvm_log = kept["podvm"]
    figures = asyncio.run(round_trips(podvm.address, args.calls))
    logged = podvm_log.written()
    figures.update(asyncio.run(error_path(podvm.address, args.errors)))
    figures["log_bytes_per_error"] = (podvm_log.written() - logged) / figures["error_calls"]
    served = starts["podvm"]
    figures.update({
        "start_median_ms": statistics.median(f.start for f in served),
        "start_p90_ms": percentile([f.start for f in served], 90),
        "first_connect_max_ms": max(f.connect for f in served),
        "idle_daemon_rss_mb": memory["podvm"][0],
        "idle_daemon_pss_mb": memory["podvm"][1],
        "daemon_rss_after_calls_mb": rss_mb(podvm.pid),
        "memory_mb": {label: {"rss": m[0], "pss": m[1]} for label, m in memory.items()},
        "fork_server_warm_cpu_ms": server_cpu,
        "served_by_fork_server": sum(1 for f in served if f.server == server),
        "starts": {label: _medians(runs) for label, runs in starts.items()},
    })
    if cold:
        figures["cold_start"] = _medians(cold)
        figures["cold_served_by_fork_server"] = sum(1 for f in cold if f.server)
    for label, (f, bundle, log) in kept.items():
        end(label, f, bundle, log)
    return figures


def _medians(runs: list[Start]) -> dict:
    return {name: statistics.median(getattr(f, name) for f in runs)
            for name in ("start", "connect", "state", "start_cpu", "daemon_cpu")}


def stop_server(where: str, code: str) -> None:
    """The fork server of `code` in `where`, stopped (SIGTERM: it removes its socket)."""
    pid = forkclient.server_pid(code, where)
    if pid is None:
        return
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.01)


def wait_server(where: str, code: str, timeout: float = 60) -> int:
    deadline = time.monotonic() + timeout
    while (pid := forkclient.server_pid(code, where)) is None:
        if time.monotonic() > deadline:
            raise SystemExit(f"no fork server came up in {where}")
        time.sleep(0.05)
    return pid


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--starts", type=int, default=30)
    parser.add_argument("--cold", type=int, default=5,
                        help="podvm starts with no fork server running (each spawns one)")
    parser.add_argument("--errors", type=int, default=20000,
                        help="State calls for an unknown id (each next to a Connect)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--go", default=GO_SHIM,
                        help="containerd's Go runc shim, whose start is measured beside "
                             "podvm's (\"\": none)")
    parser.add_argument("--also", action="append", default=[], metavar="LABEL=PATH",
                        help="another podvm shim binary (a tree before a change) whose "
                             "start is measured beside, alternated")
    args = parser.parse_args()
    also = {label: os.path.abspath(path) for label, path in
            (a.split("=", 1) for a in args.also)}
    go = args.go if args.go and os.access(args.go, os.X_OK) else ""
    if args.go and not go:
        print(f"(no Go runc shim at {args.go}: ../shared/tools/build-verify-tools.sh "
              "builds it; measuring podvm alone)", file=sys.stderr)

    shims = {"podvm": SHIM, **also, **({"go-runc": go} if go else {})}
    code = identity.own_name()  # this checkout's, as SHIM has it, in this place
    with tempfile.TemporaryDirectory(prefix="podvm-bench-") as tmp:
        root = pathlib.Path(tmp)
        grpc = str(root / "containerd.sock")
        servers = str(root / "forkservers")
        env = {**containerd_env(grpc, NS), forkclient.TEST_DIRECTORY_ENV: servers}
        try:
            figures = measure(args, shims, root, grpc, env, servers, code)
        finally:
            stop_server(servers, code)
        with contextlib.suppress(OSError):  # shared parents stay; ours, if empty, go
            os.rmdir(os.path.join(STATE_ROOT, NS))

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
        ("first Connect after start, max", f"{figures['first_connect_max_ms']:.1f} ms", ""),
        ("idle daemon RSS", f"{figures['idle_daemon_rss_mb']:.1f} MB", "target <= 22 MB"),
        ("idle daemon PSS", f"{figures['idle_daemon_pss_mb']:.1f} MB", ""),
        ("daemon RSS after the calls", f"{figures['daemon_rss_after_calls_mb']:.1f} MB", ""),
        ("fork server's warm-up CPU", f"{figures['fork_server_warm_cpu_ms']:.1f} ms", ""),
    ]
    for name, value, target in rows:
        print(f"{name:34s} {value:>10s}   {target}")
    print("\n`start` to its daemon's first answers, medians, alternated start by start (ms "
          "from just\nbefore `start` is spawned; CPU: `start`'s own + its daemon's until the "
          "State)")
    print(f"{'shim':10s} {'start':>7s} {'Connect':>8s} {'State':>7s} {'CPU':>7s} "
          f"{'(start':>7s} {'daemon)':>8s} {'Connect vs Go':>14s}")
    go_connect = figures["starts"].get("go-runc", {}).get("connect")
    rows = dict(figures["starts"])
    if "cold_start" in figures:
        rows["podvm cold"] = figures["cold_start"]
    for label, f in rows.items():
        ratio = f"{f['connect'] / go_connect:.1f}x" if go_connect else ""
        print(f"{label:10s} {f['start']:7.1f} {f['connect']:8.1f} {f['state']:7.1f} "
              f"{f['start_cpu'] + f['daemon_cpu']:7.1f} {f['start_cpu']:7.1f} "
              f"{f['daemon_cpu']:8.1f} {ratio:>14s}")
    print(f"podvm: {figures['served_by_fork_server']} of {args.starts} starts served by the "
          f"warm fork server (a node's steady state); podvm cold: {args.cold} first starts, "
          f"no fork server running (each spawns one), "
          f"{figures.get('cold_served_by_fork_server', 0)} served by one")
    print("targets: first Connect <= 60 ms after `start` began; <= 4x the Go runc shim's")
    print("\nmemory, MB (daemons idle, after their Connect and State)")
    for label, m in figures["memory_mb"].items():
        print(f"{label:12s} RSS {m['rss']:6.1f}  PSS {m['pss']:6.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
