"""What bench/reservation_vms.py runs in its pods, and reads back: busybox shell scripts
(the container rootfs is busybox) that keep what they measure on the guest's tmpfs and
print it at the end, and the host's side of the HTTP figure (a network namespace pair
with a veth, and a client).

Timing in the guest without forking: `$EPOCHREALTIME` (busybox ash, microseconds) and
`read -t 0.001` on a FIFO nobody writes to (a 1 ms sleep inside the shell)."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

HTTP_PORT = 8080
POD_ADDRESS, PEER_ADDRESS = "10.213.0.2", "10.213.0.1"
PAGE = "podvm reservation bench"

NOW = "${{EPOCHREALTIME/./}}"  # in the scripts below, which are str.format templates
CPU_BOUND = ("end=$((" + NOW + " + {usec})); echo go; "
             "for k in $(seq {loops}); do (n=0; s=" + NOW + "; "
             "while [ " + NOW + " -lt $end ]; do n=$((n+1)); done; "
             "echo loop $n $((" + NOW + " - s))) & done; wait; echo END")
"""One busy loop per vCPU until a deadline; each prints its iterations and microseconds."""
NEIGHBOUR = "for k in $(seq {loops}); do (while :; do :; done) & done; echo busy; wait"
WAKE = ("mkfifo /dev/shm/tick && exec 3<>/dev/shm/tick; end=$((" + NOW + " + {usec})); "
        "while :; do a=" + NOW + "; [ $a -lt $end ] || break; read -t 0.001 -u 3 x; "
        "b=" + NOW + "; echo $((b - a - 1000)); done > /dev/shm/late; "
        "echo SAMPLES; cat /dev/shm/late; echo END")
"""Sleeps of 1 ms until a deadline; how late each woke up, in microseconds."""


def cpu_bound(loops: int, seconds: float) -> str:
    return CPU_BOUND.format(loops=loops, usec=round(seconds * 1e6))


def wake_up(seconds: float) -> str:
    return WAKE.format(usec=round(seconds * 1e6))


def parse_cpu_bound(output: str) -> float:
    """Loop iterations per second, the mean over the loops."""
    rates = [int(w[1]) / int(w[2]) * 1e6 for w in (line.split() for line in output.splitlines())
             if len(w) == 3 and w[0] == "loop" and int(w[2]) > 0]
    if not rates:
        raise RuntimeError(f"the CPU-bound workload printed no loop: {output[-400:]!r}")
    return sum(rates) / len(rates)


def nearest_rank(ordered: list[float], p: float) -> float:
    return ordered[min(len(ordered) - 1, max(0, round(p / 100 * len(ordered)) - 1))]


def parse_wake(output: str) -> dict:
    _, _, samples = output.partition("SAMPLES\n")
    late = sorted(int(x) for x in samples.split("END")[0].split())
    if not late:  # a starved pod may take few; the sample count goes with the figures
        raise RuntimeError(f"the wake-up workload took no sample: {output[-400:]!r}")
    return {"wake_samples": len(late), "wake_p50_us": nearest_rank(late, 50),
            "wake_p99_us": nearest_rank(late, 99), "wake_p999_us": nearest_rank(late, 99.9)}


def ip(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *argv], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(argv)}: {done.stderr.strip()}")
    return done


class PodNetwork:
    """The target pod's network as CNI would leave it: `eth0` in the pod's namespace, the
    veth's other end in a peer namespace (the node's side), where the HTTP client runs.
    Both namespaces are removed on exit, and every device in them goes with them."""

    def __init__(self, prefix: str) -> None:
        self.pod, self.peer = f"{prefix}-pod", f"{prefix}-peer"

    @property
    def netns(self) -> str:
        return f"/var/run/netns/{self.pod}"

    def __enter__(self) -> PodNetwork:
        ip("netns", "add", self.peer)
        try:
            ip("netns", "add", self.pod)
            ip("-n", self.pod, "link", "add", "eth0", "type", "veth", "peer", "name", "peer0",
               "netns", self.peer)
            ip("-n", self.pod, "addr", "add", f"{POD_ADDRESS}/24", "dev", "eth0")
            ip("-n", self.peer, "addr", "add", f"{PEER_ADDRESS}/24", "dev", "peer0")
            for ns, dev in ((self.pod, "eth0"), (self.pod, "lo"), (self.peer, "peer0"),
                            (self.peer, "lo")):
                ip("-n", ns, "link", "set", dev, "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for ns in (self.pod, self.peer):
            ip("netns", "delete", ns, check=False)

    @staticmethod
    def server_script() -> str:
        return (f"mkdir -p /dev/shm/www && echo '{PAGE}' > /dev/shm/www/index.html && "
                f"echo serving && exec httpd -f -p {HTTP_PORT} -h /dev/shm/www")


def sweep_networks(prefix: str) -> None:
    """Namespaces of runs that were killed (`<prefix><pid>-...`, the pid gone)."""
    names = [line.split()[0] for line in ip("netns", "list", check=False).stdout.splitlines()
             if line.strip()]
    for name in names:
        pid = name.removeprefix(prefix).split("-")[0]
        if name.startswith(prefix) and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            ip("netns", "delete", name, check=False)


STALL_S = 10.0
"""How long one request may take before the client counts it as timed out."""
CLIENT = """import ctypes, json, socket, sys, time
ctypes.CDLL(None).prctl(1, 9)  # dies with the bench
host, port, seconds, page = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
stall = float(sys.argv[5])
request = f"GET / HTTP/1.0\\r\\nHost: {host}\\r\\n\\r\\n".encode()
def get():
    with socket.create_connection((host, port), timeout=stall) as s:
        s.sendall(request)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    if not data.startswith(b"HTTP/1.") or b" 200 " not in data.split(b"\\r\\n", 1)[0] \\
            or page.encode() not in data:
        raise RuntimeError(f"not the page: {data[:200]!r}")
deadline = time.monotonic() + 120
while True:
    try:
        get()
        break
    except OSError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.2)
for _ in range(3):
    get()
late, timeouts, start = [], 0, time.monotonic()
while time.monotonic() < start + seconds:
    t = time.perf_counter()
    try:
        get()
    except TimeoutError:  # a stalled request is a figure of the setting, at its full wait
        timeouts += 1
    late.append(time.perf_counter() - t)
print(json.dumps({"wall": time.monotonic() - start, "latency": late, "timeouts": timeouts}))
"""


async def http_client(network: PodNetwork, seconds: float) -> dict:
    """Requests back to back from the peer namespace for `seconds`, one connection
    each (busybox httpd closes it): rate, p50 and p99 (`http_figures`)."""
    proc = await asyncio.create_subprocess_exec(
        "ip", "netns", "exec", network.peer, sys.executable, "-c", CLIENT, POD_ADDRESS,
        str(HTTP_PORT), str(seconds), PAGE, str(STALL_S), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE)
    try:
        async with asyncio.timeout(seconds + 300):
            out, err = await proc.communicate()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    if proc.returncode != 0:
        raise RuntimeError(f"HTTP client exited {proc.returncode}: {err.decode()[-600:]}")
    return http_figures(out)


def http_figures(out: bytes | str) -> dict:
    """The client's figures. A request that stalls `STALL_S` is counted as timed out and
    enters the percentiles at the time it cost, as a user waiting on it would see it (a
    busy node under TCG stalled one in CI); a run in which none was answered is an error."""
    got = json.loads(out)
    late = sorted(got["latency"])
    done = len(late) - got["timeouts"]
    if not done:
        raise RuntimeError(f"the HTTP client completed no request ({len(late)} timed out)")
    return {"http_rate": done / got["wall"], "http_requests": done,
            "http_timeouts": got["timeouts"],
            "http_p50_ms": nearest_rank(late, 50) * 1000,
            "http_p99_ms": nearest_rank(late, 99) * 1000}
