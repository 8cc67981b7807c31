"""`shim delete`'s own cost: the CPU time (user + system, its waited-for children
included, as wait4 reports them) and the wall time of the process containerd runs, and
kills at 5 s, when a pod's shim is gone. Beside containerd's Go runc shim's `delete` on
a bundle of its own (it runs `runc delete --force`, which it waits for: counted), in the
same run, alternated run by run, on the machine as it is and with one core busy besides
(a spinning process on the first CPU, as `make test-busy` has it).

Then podvm's alone where a killed daemon left its pod's state directory (its `delete` has
work: the removal's code loads).

Each run is as containerd makes it: the flags, the environment, stdin /dev/null, the
bundle as working directory (the Go shim finds its bundle as ../<id> from there).

Target (issue 47): podvm's `delete` at most 60 ms of CPU on an idle machine.

usage: python bench/delete_bench.py [--runs N] [--shim LABEL=PATH ...] [--go PATH] [--json]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from shim.host import paths  # noqa: E402
from testbed.shimproc import SHIM, make_bundle  # noqa: E402

NS = "podvm-bench-delete"
GO_SHIM = "/root/.cache/verify/bin/containerd-shim-runc-v2"
"""containerd 2.3.4's runc shim, as ../shared/tools/build-verify-tools.sh builds it."""


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]


def leave_state(group: str) -> pathlib.Path:
    """What a daemon that was killed leaves (its `delete` then has work): the pod's state
    directory with its shim.json, naming a pid no process has."""
    state_dir = pathlib.Path(paths.state_dir(NS, group))
    state_dir.mkdir(parents=True, exist_ok=True)
    (state_dir / "shim.json").write_text(json.dumps({"pid": 2 ** 22 + 1, "address": None}))
    return state_dir


def run_delete(shim: str, bundle: pathlib.Path, grpc: str,
               out: pathlib.Path) -> tuple[float, float]:
    """One `delete` of the container `bundle.name`: (CPU seconds, wall seconds)."""
    env = {**os.environ, "TTRPC_ADDRESS": grpc + ".ttrpc", "GRPC_ADDRESS": grpc,
           "NAMESPACE": NS, "MAX_SHIM_VERSION": "2"}
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # an installed shim has its bytecode
    argv = [shim, "-namespace", NS, "-address", grpc, "-publish-binary",
            "/usr/bin/containerd", "-id", bundle.name, "delete"]
    with open(out / "stdout", "wb") as stdout, open(out / "stderr", "wb") as stderr:
        begun = time.perf_counter()
        proc = subprocess.Popen(argv, cwd=bundle, env=env, stdin=subprocess.DEVNULL,
                                stdout=stdout, stderr=stderr)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - begun
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{shim} delete failed ({proc.returncode}): "
                         f"{(out / 'stderr').read_text()[-2000:]}")
    if not (out / "stdout").read_bytes():
        raise SystemExit(f"{shim} delete printed no DeleteResponse")
    return usage.ru_utime + usage.ru_stime, wall


class Hog:
    """One core kept busy: a spinning process on the first CPU this one may use."""

    def __enter__(self) -> "Hog":
        cpu = min(os.sched_getaffinity(0))
        self._proc = subprocess.Popen(
            [sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{cpu}}})\n"
             "while True: pass"])
        time.sleep(0.3)
        return self

    def __exit__(self, *exc: object) -> None:
        self._proc.kill()
        self._proc.wait()


def measure(shims: dict[str, str], runs: int, root: pathlib.Path,
            state_left: bool = False) -> dict:
    grpc = str(root / "containerd.sock")
    out = root / "out"
    out.mkdir(parents=True)
    figures: dict[str, dict[str, list[float]]] = {n: {"cpu": [], "wall": []} for n in shims}
    bundles = {n: make_bundle(root / n, f"gone-{i}", sandbox_id=f"gone-{i}")
               for i, n in enumerate(shims)}
    for name, shim in shims.items():  # not measured: the first compiles what changed
        run_delete(shim, bundles[name], grpc, out)
    for _ in range(runs):
        for name, shim in shims.items():
            state_dir = leave_state(bundles[name].name) if state_left else None
            cpu, wall = run_delete(shim, bundles[name], grpc, out)
            if state_dir is not None and state_dir.exists():
                raise SystemExit(f"{shim} delete left {state_dir}")
            figures[name]["cpu"].append(cpu)
            figures[name]["wall"].append(wall)
    return {name: {"cpu_p50_ms": statistics.median(f["cpu"]) * 1e3,
                   "cpu_p90_ms": percentile(f["cpu"], 90) * 1e3,
                   "cpu_max_ms": max(f["cpu"]) * 1e3,
                   "wall_p50_ms": statistics.median(f["wall"]) * 1e3,
                   "wall_max_ms": max(f["wall"]) * 1e3}
            for name, f in figures.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--shim", action="append", default=[], metavar="LABEL=PATH",
                        help="a podvm shim binary to measure (default: podvm=this "
                             "checkout's); repeat to compare trees in one run")
    parser.add_argument("--go", default=GO_SHIM, help="containerd's Go runc shim")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    shims = {label: os.path.abspath(path) for label, path in
             (s.split("=", 1) for s in args.shim)} or {"podvm": SHIM}
    if not os.access(args.go, os.X_OK):
        raise SystemExit(f"no Go runc shim at {args.go}: ../shared/tools/"
                         "build-verify-tools.sh builds it")
    shims["go-runc"] = args.go
    results = {}
    with tempfile.TemporaryDirectory(prefix="podvm-delete-bench-") as tmp:
        results["as found"] = measure(shims, args.runs, pathlib.Path(tmp) / "idle")
        with Hog():
            results["+busy core"] = measure(shims, args.runs, pathlib.Path(tmp) / "busy")
        podvm_only = {n: s for n, s in shims.items() if n != "go-runc"}
        results["state left"] = measure(podvm_only, args.runs, pathlib.Path(tmp) / "left",
                                        state_left=True)
        with contextlib.suppress(OSError):  # shared parents stay; ours, if empty, go
            os.rmdir(os.path.join(paths.STATE_ROOT, NS))
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, {args.runs} deletes "
          f"each, alternated; CPU = user + system of the process and what it waited for")
    print(f"{'load':10s} {'shim':12s} {'CPU p50':>9s} {'p90':>8s} {'max':>8s} "
          f"{'wall p50':>9s} {'max':>8s}")
    for load, by_shim in results.items():
        for name, f in by_shim.items():
            print(f"{load:10s} {name:12s} {f['cpu_p50_ms']:7.1f}ms "
                  f"{f['cpu_p90_ms']:6.1f}ms {f['cpu_max_ms']:6.1f}ms "
                  f"{f['wall_p50_ms']:7.1f}ms {f['wall_max_ms']:6.1f}ms")
    print("as found: the machine as it is (say its load); +busy core: and one core spinning;"
          "\nstate left: a killed daemon's state directory to remove. Target: podvm's CPU "
          "p50 <= 60 ms on an idle machine")
    return 0


if __name__ == "__main__":
    sys.exit(main())
