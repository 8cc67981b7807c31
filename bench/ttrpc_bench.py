"""ttrpc and shim process figures: unary round trips (sequential and pipelined) against a
real shim daemon, the wall time of `start` and the RSS of an idle daemon.

Targets (issue: foundation), measured against on these machines: idle daemon RSS <= 22 MB
(Kata's Go shim 39 MB, runc's shim 9-11 MB); `start` median <= 50 ms (Kata 64 ms, runc
17 ms); pipelined calls within 3x of Go ttrpc (about 22 us per call, so <= 66 us).

usage: python bench/ttrpc_bench.py [--calls N] [--starts N] [--json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from shim.pb.containerd.task.v2 import shim_pb2 as api  # noqa: E402
from shim.ttrpc import Client  # noqa: E402
from tests.shim.shimproc import daemon_pid, make_bundle, run_shim  # noqa: E402

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


def rss_mb(pid: int) -> float:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--starts", type=int, default=30)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="podvm-bench-") as tmp:
        root = pathlib.Path(tmp)
        grpc = str(root / "containerd.sock")
        start_ms = []
        for i in range(args.starts):
            bundle = make_bundle(root, f"s{i}", sandbox_id=f"s{i}")
            t = time.perf_counter()
            result = run_shim(bundle, f"s{i}", "start", grpc, namespace=NS)
            start_ms.append((time.perf_counter() - t) * 1e3)
            if result.returncode != 0:
                raise SystemExit(result.stderr.decode())
            if i:
                run_shim(bundle, f"s{i}", "delete", grpc, namespace=NS)
        bundle = root / "s0"
        address = (bundle / "address").read_text()
        pid = daemon_pid(NS, "s0")
        time.sleep(1.0)
        idle_rss = rss_mb(pid)
        figures = asyncio.run(round_trips(address, args.calls))
        figures.update({
            "start_median_ms": statistics.median(start_ms),
            "start_p90_ms": percentile(start_ms, 90),
            "idle_daemon_rss_mb": idle_rss,
            "daemon_rss_after_calls_mb": rss_mb(pid),
        })
        run_shim(bundle, "s0", "delete", grpc, namespace=NS)

    if args.json:
        print(json.dumps(figures, indent=2))
        return 0
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, {args.calls} calls, "
          f"{args.starts} starts")
    rows = [
        ("unary round trip p50", f"{figures['unary_p50_us']:.1f} us", ""),
        ("unary round trip p99", f"{figures['unary_p99_us']:.1f} us", ""),
        ("sequential calls/s", f"{figures['sequential_calls_per_s']:.0f}", ""),
        ("pipelined (64) calls/s", f"{figures['pipelined64_calls_per_s']:.0f}", ""),
        ("pipelined (64) per call", f"{figures['pipelined64_us_per_call']:.1f} us",
         "target <= 66 us (3x Go ttrpc)"),
        ("start median", f"{figures['start_median_ms']:.1f} ms", "target <= 50 ms"),
        ("start p90", f"{figures['start_p90_ms']:.1f} ms", ""),
        ("idle daemon RSS", f"{figures['idle_daemon_rss_mb']:.1f} MB", "target <= 22 MB"),
        ("daemon RSS after the calls", f"{figures['daemon_rss_after_calls_mb']:.1f} MB", ""),
    ]
    for name, value, target in rows:
        print(f"{name:28s} {value:>12s}   {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
