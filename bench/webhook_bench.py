"""Admission latency and throughput of podvm-webhook over HTTPS, the server pinned to one
CPU core (sched_setaffinity), the client on the others.

Each request is an AdmissionReview as the API server sends it for a static-mode podvm
pod that is admitted and patched (the webhook's most expensive answer: the pod read, the
shim's plan, the annotations as a JSONPatch). Connections are kept alive, as the API
server keeps them. Two runs:
- offered load: requests started on a fixed schedule (`--rate` per second, open loop);
  a request's latency counts from when it was due, so a server that falls behind is seen
  behind (no coordinated omission). Target: p99 <= 5 ms at 200 requests/s.
- max: `--concurrency` requests in flight at all times (closed loop); requests/s is the
  server's, as long as the client's cores are not the limit (the client's CPU time is
  printed).

On a machine other work keeps busy, a wake-up waits for the CPU and that wait, not the
webhook, makes the tail: `--realtime` runs server and client SCHED_FIFO (root; the kernel
still leaves 5% of each CPU to others) so the figures are the webhook's. The server's CPU
time per admission is printed either way: it bounds what one core can answer.

usage: python bench/webhook_bench.py [--rate 200] [--seconds 10] [--concurrency 16]
                                     [--realtime]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import resource
import ssl
import sys
import tempfile
import time

import aiohttp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from testbed.webhook import REALTIME_PRIORITY, Webhook, container, pod, review

CONFIG = """\
[hypervisor.qemu]
enable_annotations = ["default_vcpus", "default_memory"]
[runtime]
static_sandbox_resource_mgmt = true
"""
WARMUP = 300


def body() -> bytes:
    admitted = pod(container("app", cpu="2", memory="512Mi"), container("log", cpu="100m",
                                                                        memory="64Mi"),
                   overhead={"cpu": "1", "memory": "448Mi"},
                   annotations={"example.com/team": "web"})
    return json.dumps(review(admitted)).encode()


class Client:
    def __init__(self, webhook: Webhook, connections: int) -> None:
        context = ssl.create_default_context(cafile=str(webhook.trusted[0]))
        self.url = f"https://localhost:{webhook.port}/mutate"
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(
            limit=connections, ssl=context))
        self.body = body()
        self.failures = 0

    async def admit(self) -> None:
        async with self.session.post(self.url, data=self.body, headers={
                "Content-Type": "application/json"}) as r:
            answer = await r.json()
        if r.status != 200 or "patch" not in answer["response"]:
            self.failures += 1


async def offered(client: Client, rate: float, seconds: float) -> tuple[list[float], float]:
    """Latencies (s) from each request's due time, and the achieved rate."""
    latencies: list[float] = []

    async def one(due: float) -> None:
        await client.admit()
        latencies.append(time.perf_counter() - due)

    tasks = []
    start = time.perf_counter()
    for i in range(int(rate * seconds)):
        due = start + i / rate
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(one(due)))
    await asyncio.gather(*tasks)
    return latencies, len(latencies) / (time.perf_counter() - start)


async def closed(client: Client, concurrency: int, seconds: float
                 ) -> tuple[list[float], float]:
    latencies: list[float] = []
    deadline = time.perf_counter() + seconds

    async def worker() -> None:
        while time.perf_counter() < deadline:
            sent = time.perf_counter()
            await client.admit()
            latencies.append(time.perf_counter() - sent)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies, len(latencies) / (time.perf_counter() - start)


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]


def line(what: str, latencies: list[float], rate: float) -> str:
    return (f"{what:<32} {rate:8.0f} req/s   p50 {percentile(latencies, 50) * 1000:6.2f} ms"
            f"   p99 {percentile(latencies, 99) * 1000:6.2f} ms   max "
            f"{max(latencies) * 1000:7.2f} ms   ({len(latencies)} requests)")


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def server_cpu_seconds(webhook: Webhook) -> float:
    """utime + stime of the server process (clock ticks, from /proc)."""
    assert webhook.proc is not None
    with open(f"/proc/{webhook.proc.pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cost(webhook: Webhook, cpu_before: float, requests: int) -> str:
    """The server's CPU time per admission: what bounds one core, whatever else runs."""
    per_request = (server_cpu_seconds(webhook) - cpu_before) / requests
    return (f"{'':32} server CPU {per_request * 1e6:6.0f} µs per admission = "
            f"{1 / per_request:6.0f} req/s per core")


async def run(webhook: Webhook, args: argparse.Namespace) -> bool:
    client = Client(webhook, max(args.concurrency, 64))
    try:
        await asyncio.gather(*(client.admit() for _ in range(WARMUP)))
        server = server_cpu_seconds(webhook)
        latencies, rate = await offered(client, args.rate, args.seconds)
        print(line(f"offered {args.rate:g} req/s", latencies, rate))
        print(cost(webhook, server, len(latencies)))
        p99 = percentile(latencies, 99)
        used, server = cpu_seconds(), server_cpu_seconds(webhook)
        latencies, rate = await closed(client, args.concurrency, args.seconds)
        print(line(f"max ({args.concurrency} in flight)", latencies, rate))
        print(cost(webhook, server, len(latencies)))
        print(f"client CPU during max: {(cpu_seconds() - used) / args.seconds:.2f} cores "
              f"of {len(os.sched_getaffinity(0))}")
        if client.failures:
            print(f"FAILED: {client.failures} answers were not a patch")
            return False
        print(f"target p99 <= 5 ms at {args.rate:g} req/s: "
              f"{'met' if p99 <= 0.005 else 'NOT met'} ({p99 * 1000:.2f} ms)")
        return True
    finally:
        await client.session.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", type=float, default=200, help="offered requests per second")
    p.add_argument("--seconds", type=float, default=10, help="length of each run")
    p.add_argument("--concurrency", type=int, default=16, help="in flight, max run")
    p.add_argument("--realtime", action="store_true",
                   help="server and client SCHED_FIFO: other work's load left out")
    args = p.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    server_cpu = cpus[-1]
    client_cpus = set(cpus[:-1]) or {server_cpu}
    print(f"podvm-webhook on CPU {server_cpu}, client on CPUs "
          f"{','.join(map(str, sorted(client_cpus)))}; load average "
          f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs"
          + ("; SCHED_FIFO" if args.realtime else ""))
    with tempfile.TemporaryDirectory(prefix="webhook-bench-") as tmp:
        webhook = Webhook(pathlib.Path(tmp), CONFIG).start(cpus={server_cpu},
                                                           realtime=args.realtime)
        try:
            os.sched_setaffinity(0, client_cpus)
            if args.realtime:
                os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(REALTIME_PRIORITY))
            ok = asyncio.run(run(webhook, args))
        finally:
            status = webhook.stop()
        if status != 0:
            print(f"podvm-webhook exited {status}: {webhook.log_text()}")
            return 1
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
