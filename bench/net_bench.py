"""Pod-to-pod networking on the CNI bridge of a private containerd, podvm against runc:
small HTTP requests (rate, p50 and p99 latency) and one bulk transfer (throughput), for a
podvm pod fetching from a podvm pod and for a runc pod fetching from a runc pod.

The server pod runs busybox httpd serving a small page and a bulk file (made with dd),
both on the pod's /dev/shm (a tmpfs for either runtime, so the disk or the VM's 9p share
is not what is measured). The client pod runs busybox: one shell loop of
`wget -q -O /dev/null` requests, one after the other, each timed with busybox `adjtimex`
(time.tv_sec, time.tv_usec) before and after it in the same loop. The cost of an empty
timestamp pair is measured the same way and subtracted; what remains of a request's
latency still includes starting wget (fork+exec, in a VM under TCG for podvm). The
request rate is that of one client's back-to-back requests: 1 / mean latency.

All traffic stays on the test bridge of this machine (testbed/bridgenet.py: a private
subnet, no default route, no masquerade); every loop is bounded and every command has a
deadline. Everything the bench makes (pods, containerd, bridge) is removed at the end, on
failure and on Ctrl-C (SIGTERM too) by the harness.

usage: python bench/net_bench.py [--requests N] [--bulk-mib M] [--accel tcg|kvm]
"""
from __future__ import annotations

import argparse
import os
import pathlib
import signal
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from testbed.containerd import Containerd  # noqa: E402
from testbed.cri import Crictl, write_config  # noqa: E402
from testbed.netpods import (HTTP_PORT, fetch_from_pod, pod_ip, pod_network_config,  # noqa: E402
                             url, wait_for_port)
from testbed.pods import container_config  # noqa: E402
from testbed.vmconfig import warm_templates, write_test_config  # noqa: E402

MIB = 1 << 20
PAGE = "podvm net_bench: a small page"
WWW = "/dev/shm/www"  # a tmpfs in the guest and in a runc pod alike
WARMUP = 3  # untimed requests before the timed ones
MAX_BULK_MIB = 48  # CRI gives a runc pod a 64 MiB /dev/shm


def server_script(bulk_mib: int) -> str:
    """busybox httpd on HTTP_PORT serving PAGE as / and `bulk_mib` MiB of zeros as /bulk;
    it listens only once the bulk file is made."""
    return (f"mkdir -p {WWW} && echo '{PAGE}' > {WWW}/index.html && "
            f"dd if=/dev/zero of={WWW}/bulk bs=1M count={bulk_mib} 2>/dev/null && "
            f"exec httpd -f -p {HTTP_PORT} -h {WWW}")


def timed_loop(n: int, command: str) -> str:
    """A shell script: `n` times, a timestamp, `command`, a timestamp and the command's
    exit status; the output goes to a tmpfs file while the loop runs, and is printed
    after it."""
    out = "/dev/shm/net_bench.out"
    return (f"i=0; while [ $i -lt {n} ]; do adjtimex; {command}; rc=$?; adjtimex; "
            f"echo \"rc $rc\"; i=$((i+1)); done > {out} 2>&1; cat {out}; rm -f {out}")


def parse_loop(output: str, n: int, what: str) -> list[float]:
    """Microseconds between each pair of timestamps the loop printed; fails unless there
    are `n` pairs and every command exited 0."""
    stamps: list[int] = []
    codes: list[int] = []
    sec = None
    for line in output.splitlines():
        words = line.split()
        if line.strip().startswith("time.tv_sec:"):
            sec = int(words[-1])
        elif line.strip().startswith("time.tv_usec:"):
            assert sec is not None, f"{what}: tv_usec before tv_sec in {output[:400]!r}"
            stamps.append(sec * 1_000_000 + int(words[-1]))
            sec = None
        elif words[:1] == ["rc"]:
            codes.append(int(words[1]))
    if len(stamps) != 2 * n or len(codes) != n:
        raise RuntimeError(f"{what}: expected {n} timed runs, got {len(stamps)} timestamps "
                           f"and {len(codes)} exit codes; output starts {output[:600]!r}")
    failed = [c for c in codes if c != 0]
    if failed:
        raise RuntimeError(f"{what}: {len(failed)} of {n} runs failed (exit {failed[0]})")
    return [float(stamps[2 * k + 1] - stamps[2 * k]) for k in range(n)]


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


class Bench:
    def __init__(self, ctd: Containerd, crictl: Crictl, work: pathlib.Path,
                 requests: int, bulk_mib: int) -> None:
        self.ctd, self.crictl, self.work = ctd, crictl, work
        self.requests, self.bulk_mib = requests, bulk_mib

    def pod(self, name: str, runtime: str, script: str) -> tuple[str, str]:
        """(pod id, container id) of a pod on the bridge running `script`."""
        pod_file = write_config(self.work, f"pod-{name}.json",
                                pod_network_config(self.ctd, self.work, name))
        pod_id = self.crictl.runp(pod_file, runtime=runtime)
        cfile = write_config(self.work, f"{name}-c.json", container_config(name, script))
        cid = self.crictl.create(pod_id, cfile, pod_file)
        self.crictl.start(cid)
        return pod_id, cid

    def shell(self, cid: str, script: str, deadline: int) -> str:
        """`script`'s stdout in the container; the exec ends after `deadline` seconds."""
        r = self.crictl.run("exec", "-s", "--timeout", str(deadline), cid, "sh", "-c",
                            script, check=False, timeout=deadline + 60)
        if r.returncode != 0:
            raise RuntimeError(f"exec in {cid[:13]} exited {r.returncode} (deadline "
                               f"{deadline}s): {r.stderr.strip()[-600:]}")
        return r.stdout

    def measure(self, runtime: str) -> dict[str, float]:
        """Server and client pods of `runtime`, their figures, then both pods removed."""
        started = time.monotonic()
        pods = []
        try:
            server_pod, server = self.pod(f"srv-{runtime}", runtime,
                                          server_script(self.bulk_mib))
            pods.append(server_pod)
            client_pod, client = self.pod(f"cli-{runtime}", runtime, "sleep 3600")
            pods.append(client_pod)
            wait_for_port(self.crictl, server, timeout=120)
            ip = pod_ip(self.crictl, server_pod)
            page = fetch_from_pod(self.crictl, client, url(ip), timeout=60)
            if page != PAGE + "\n":
                raise RuntimeError(f"{runtime}: the client got {page!r}, not the page")
            print(f"{runtime}: server {ip}, client {pod_ip(self.crictl, client_pod)}, "
                  f"pods ready in {time.monotonic() - started:.1f} s", flush=True)
            head = self.shell(client, f"wget -q -S --spider {url(ip, path='/bulk')} 2>&1",
                              60)
            length = [ln.split()[-1] for ln in head.splitlines()
                      if ln.strip().lower().startswith("content-length:")]
            if length != [str(self.bulk_mib * MIB)]:
                raise RuntimeError(f"{runtime}: /bulk is not {self.bulk_mib} MiB: {head!r}")

            n = self.requests
            empty = parse_loop(self.shell(client, timed_loop(n, "true"), 30 + 2 * n),
                               n, f"{runtime} empty timestamp pairs")
            pair = statistics.median(empty)
            get = f"wget -q -O /dev/null {url(ip)}"
            warm = f"for w in $(seq {WARMUP}); do {get} || exit 1; done; "
            raw = parse_loop(self.shell(client, warm + timed_loop(n, get), 60 + n),
                             n, f"{runtime} requests")
            latency = [max(0.0, t - pair) for t in raw]
            bulk_get = f"wget -q -O /dev/null {url(ip, path='/bulk')}"
            bulk = parse_loop(self.shell(client, timed_loop(1, bulk_get),
                                         120 + 10 * self.bulk_mib), 1, f"{runtime} bulk")
            bulk_s = max(bulk[0] - pair, 1.0) / 1e6
        finally:
            for pod_id in pods:
                self.crictl.run("stopp", pod_id, check=False)
                self.crictl.run("rmp", pod_id, check=False)
        figures = {"rate": 1e6 / statistics.fmean(latency),
                   "p50": percentile(latency, 50) / 1000,
                   "p99": percentile(latency, 99) / 1000,
                   "bulk": self.bulk_mib / bulk_s,
                   "pair": pair / 1000}
        print(f"{runtime}: {n} requests, p50 {figures['p50']:.2f} ms, bulk "
              f"{figures['bulk']:.1f} MiB/s ({time.monotonic() - started:.0f} s in all)",
              flush=True)
        return figures


def machine(accel: str) -> str:
    cpus = len(os.sched_getaffinity(0))
    model = next((ln.split(":", 1)[1].strip()
                  for ln in pathlib.Path("/proc/cpuinfo").read_text().splitlines()
                  if ln.startswith("model name")), "?")
    return f"{cpus} CPUs ({model}), podvm accel={accel}"


def loadavg() -> str:
    return " ".join(pathlib.Path("/proc/loadavg").read_text().split()[:3])


def terminated(signum: int, frame: object) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.exit(128 + signum)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=300,
                        help="timed small requests per runtime (default 300)")
    parser.add_argument("--bulk-mib", type=int, default=32,
                        help=f"size of the bulk transfer, 1 to {MAX_BULK_MIB} (default 32)")
    parser.add_argument("--accel", default="tcg", help="podvm's QEMU accel (default tcg)")
    args = parser.parse_args()
    if args.requests < 2:
        parser.error("--requests must be at least 2")
    if not 1 <= args.bulk_mib <= MAX_BULK_MIB:
        parser.error(f"--bulk-mib must be 1 to {MAX_BULK_MIB} (a runc pod's /dev/shm is "
                     f"64 MiB)")
    # SIGTERM unwinds like Ctrl-C: the harness removes the pods, containerd and bridge
    # (a second SIGTERM does not interrupt that).
    signal.signal(signal.SIGTERM, terminated)
    load_before = loadavg()
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="podvm-net-bench-") as tmp:
        work = pathlib.Path(tmp)
        config = write_test_config(work / "podvm.toml", accel=args.accel,
                                   template_path=str(work / "templates"))
        warm_templates(config)
        ctd = Containerd(work / "containerd", namespace="podvm-net-bench", cri=True,
                         podvm_config=config)
        with ctd:
            if ctd.network is None:
                raise SystemExit("net_bench needs the CNI plugins and iproute2 "
                                 "(Debian packages containernetworking-plugins, iproute2)")
            print(f"private containerd, bridge {ctd.network.bridge} "
                  f"({ctd.network.subnet})", flush=True)
            ctd.import_cri_images(work)
            bench = Bench(ctd, Crictl(ctd.cri_endpoint, timeout="120s"), work,
                          args.requests, args.bulk_mib)
            for runtime in ("runc", "podvm"):  # one pair at a time: nothing else runs
                results[runtime] = bench.measure(runtime)
        if ctd.forced:
            print(f"warning: the harness had to force its cleanup: {ctd.forced}",
                  file=sys.stderr)

    v, r = results["podvm"], results["runc"]
    rows = [
        ("small HTTP requests, rate (req/s)", "rate", "{:.1f}"),
        ("small HTTP requests, p50 latency (ms)", "p50", "{:.2f}"),
        ("small HTTP requests, p99 latency (ms)", "p99", "{:.2f}"),
        (f"bulk transfer, {args.bulk_mib} MiB (MiB/s)", "bulk", "{:.1f}"),
        ("empty timestamp pair, subtracted (ms)", "pair", "{:.2f}"),
    ]
    print()
    print(f"machine: {machine(args.accel)}; load average {load_before} before, "
          f"{loadavg()} after")
    print(f"{args.requests} timed requests per runtime, one client, one at a time "
          f"(after {WARMUP} untimed); pod to pod on one bridge")
    width = max(len(label) for label, _, _ in rows)
    print(f"{'workload':<{width}}  {'podvm':>10}  {'runc':>10}  {'podvm/runc':>10}")
    for label, key, fmt in rows:
        ratio = v[key] / r[key] if r[key] else float("nan")
        print(f"{label:<{width}}  {fmt.format(v[key]):>10}  {fmt.format(r[key]):>10}  "
              f"{ratio:>10.2f}")
    print("a request's latency includes starting busybox wget in the client pod "
          "(fork+exec), the empty timestamp pair's cost taken out; rate = 1 / mean latency")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # everything is removed by then
        print("net_bench: interrupted; pods, containerd and bridge removed", file=sys.stderr)
        sys.exit(130)
