"""What the guest's and QEMU's hardening costs: runp-to-ready and an idle pod's memory
(charged to its sandbox cgroup; QEMU's RSS) for the old fast kernel line, each of the
guest kernel's defences added back to it alone, the new default, and QEMU confined or
not, each booting and restoring a template. Pods run one at a time through the CRI on a
private containerd, the configurations alternated pod by pod (the order reversed every
other round) so that drift on a shared machine hits all alike; medians and min-max.

Each configuration is a podvm configuration file rewritten before its pod's runp (a
pod's shim reads it at its Create). "+ X" rows: the default line with the other three
weakening parameters of FAST_PARAMS (shim/vm/qemu/driver.py) added back through
kernel_params. With templates every configuration's template is made by a warm-up pod
first (a different kernel line is a different template), not counted.

The PVH-booted vmlinux is never relocated, so its "+ KASLR" row measures a no-op;
--bzimage adds a row with the compressed kernel, whose decompressor does relocate it.

--before-tree DIR adds a row whose pods run the shim of another checkout (e.g. `git
worktree add /tmp/before <rev>`: the code before a hardening change) beside this one's,
through a second runtime of the same containerd, alternated with the others: a change's
cost measured before and after in one run. --rows jail keeps only that row and the
defaults.

usage: python bench/hardening_bench.py [--rounds N] [--settle S] [--accel tcg|kvm]
                                       [--only boot|template] [--bzimage VMLINUZ]
                                       [--before-tree DIR] [--rows all|jail]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench.density import charged_bytes, process_cpu_s, sandbox_cgroups, status_kib  # noqa: E402
from shim.config import HypervisorConfig  # noqa: E402
from shim.vm.qemu.command import FAST_PARAMS  # noqa: E402
import testbed.containerd as harness  # noqa: E402
from testbed.containerd import Containerd  # noqa: E402
from testbed.cri import Crictl, write_config  # noqa: E402
from testbed.pods import pod_config, pod_qemus  # noqa: E402
from testbed.vmconfig import warm_templates, write_test_config  # noqa: E402

MIB = 1 << 20
DEFENCES = {"KASLR": "nokaslr", "mitigations": "mitigations=off",
            "LSMs": "lsm=capability", "init_on_alloc": "init_on_alloc=0"}
UNCONFINED = {"seccompsandbox": "", "enable_jail": False}
"""QEMU's confinement off (the keys that exist in shim/config.py)."""


BEFORE = "podvm-before"
"""The runtime whose shim is --before-tree's (RUNTIME: the key of a row that uses it)."""
RUNTIME = "_runtime"


def configurations(bzimage: str = "", before: str = "",
                   only_jail: bool = False) -> dict[str, dict[str, object]]:
    """Row name -> [hypervisor.qemu] keys (RUNTIME: the runtime that runs its pods)."""
    if only_jail:
        return {**({f"before: {before}": {RUNTIME: BEFORE}} if before else {}),
                "after: the defaults": {}}
    unconfined = {k: v for k, v in UNCONFINED.items()
                  if k in {f.name for f in dataclasses.fields(HypervisorConfig)}}
    rows: dict[str, dict[str, object]] = {}
    if unconfined:
        rows["before: fast line, QEMU unconfined"] = dict(guest_kernel_hardening=False,
                                                          **unconfined)
    rows["fast line (guest_kernel_hardening = false)"] = {"guest_kernel_hardening": False}
    for name, weak in DEFENCES.items():
        others = " ".join(w for w in FAST_PARAMS.split() if w != weak)
        rows[f"  + {name} alone"] = {"kernel_params": others}
        if name == "KASLR" and bzimage:
            rows["  + KASLR alone, bzImage"] = {"kernel_params": others, "kernel": bzimage}
    if unconfined:
        rows["default line, QEMU unconfined"] = dict(unconfined)
    if before:
        rows[f"before: {before}"] = {RUNTIME: BEFORE}
    rows["after: the defaults"] = {}
    return rows


def before_config(config: pathlib.Path) -> pathlib.Path:
    """The configuration file of --before-tree's runtime, beside this tree's."""
    return config.with_name(f"before-{config.name}")


def before_runtime(tree: pathlib.Path, work: pathlib.Path) -> set[str]:
    """A second podvm runtime whose shim is `tree`'s: containerd runs
    containerd-shim-podvmbefore-v2 from its PATH, a wrapper that imports the shim from
    `tree` (with this checkout's generated protobuf modules where it has none)."""
    if not (tree / "shim" / "contract" / "cli.py").is_file():
        raise SystemExit(f"--before-tree {tree}: not a podvm checkout")
    if not (tree / "podvm_core" / "pb").is_dir():
        shutil.copytree(pathlib.Path(__file__).resolve().parents[1] / "podvm_core" / "pb",
                        tree / "podvm_core" / "pb")
    bindir = work / "before-bin"
    bindir.mkdir()
    wrapper = bindir / "containerd-shim-podvmbefore-v2"
    wrapper.write_text(f"#!/bin/sh\nexport PYTHONPATH={tree}\nexec {sys.executable} -c "
                       f"'import sys; from shim.contract.cli import main; sys.exit(main())' "
                       f"\"$@\"\n")
    wrapper.chmod(0o755)
    os.environ["PATH"] = f"{bindir}:{os.environ['PATH']}"
    section = harness.podvm_runtime_section

    def both(config_path: str | None) -> str:
        text = section(config_path)
        again = text.replace(".runtimes.podvm]", f".runtimes.{BEFORE}]").replace(
            ".runtimes.podvm.options]", f".runtimes.{BEFORE}.options]").replace(
            '"io.containerd.podvm.v2"', '"io.containerd.podvmbefore.v2"').replace(
            str(config_path), str(before_config(pathlib.Path(str(config_path)))))
        return text + "\n" + again

    harness.podvm_runtime_section = both
    return before_keys(tree)


def before_keys(tree: pathlib.Path) -> set[str]:
    """The configuration keys `tree`'s shim knows (it refuses any other)."""
    out = subprocess.run(
        [sys.executable, "-c", "import dataclasses, shim.config as c; print(' '.join("
         "f.name for d in (c.HypervisorConfig, c.RuntimeConfig) for f in dataclasses.fields(d)))"],
        env=dict(os.environ, PYTHONPATH=str(tree)), cwd=tree, capture_output=True,
        text=True, check=True).stdout
    return set(out.split())


@dataclasses.dataclass
class Sample:
    ready_s: float
    cpu_s: float
    """QEMU's CPU time (all threads) from its start to the pod's ready: the work a boot
    or restore takes, which other load on the machine stretches far less than ready."""
    charged_mib: float
    qemu_rss_mib: float


def write(path: pathlib.Path, work: pathlib.Path, accel: str, template: bool,
          keys: dict[str, object], known: set[str] | None = None) -> None:
    """The configuration of a row; one of --before-tree's goes to before_config(path),
    without the keys that tree does not know (`known`)."""
    if keys.get(RUNTIME) == BEFORE:
        assert known is not None
        write(path, work, accel, template, {k: v for k, v in keys.items() if k != RUNTIME})
        before = before_config(path)
        before.write_text("".join(
            line for line in path.read_text().splitlines(keepends=True)
            if "=" not in line or line.split("=", 1)[0].strip() in known or
            line.lstrip().startswith("[")))
        return
    own = {k: v for k, v in keys.items() if k == "kernel"}  # write_test_config writes it
    write_test_config(path, accel=accel, enable_template=template,
                      template_path=str(work / "templates"), **own)
    lines = "".join(f"{k} = {json.dumps(v)}\n" for k, v in keys.items()
                    if k not in own and k != RUNTIME)
    path.write_text(path.read_text().replace("[runtime]\n", lines + "[runtime]\n", 1))
    warm_templates(path)  # each configuration's own, before its first pod


def one_pod(ctd: Containerd, crictl: Crictl, work: pathlib.Path, name: str,
            settle: float, runtime: str = "podvm") -> Sample:
    pod_file = write_config(work, f"{name}.json", pod_config(ctd, work, name))
    started = time.monotonic()
    pod_id = crictl.runp(pod_file, runtime=runtime)
    try:
        ready = time.monotonic() - started
        (qemu,) = pod_qemus(pod_id)
        cpu = process_cpu_s(qemu)
        time.sleep(settle)
        return Sample(ready, cpu, charged_bytes(sandbox_cgroups(qemu)) / MIB,
                      status_kib(qemu, "VmRSS") / 1024)
    finally:
        crictl.run("stopp", pod_id, check=False)
        crictl.run("rmp", pod_id, check=False)


def run(args: argparse.Namespace) -> dict[tuple[str, str], list[Sample]]:
    rows = configurations(args.bzimage, args.before_tree, args.rows == "jail")
    modes = [m for m in ("boot", "template") if args.only in ("", m)]
    samples: dict[tuple[str, str], list[Sample]] = {(r, m): [] for r in rows for m in modes}
    with tempfile.TemporaryDirectory(prefix="podvm-hardening-") as tmp:
        work = pathlib.Path(tmp)
        known = before_runtime(pathlib.Path(args.before_tree).resolve(), work) \
            if args.before_tree else None
        config = work / "podvm.toml"
        write(config, work, args.accel, False, {})
        with Containerd(work / "containerd", namespace="podvm-hardening", cri=True,
                        podvm_config=config) as ctd:
            ctd.import_cri_images(work)
            crictl = Crictl(ctd.cri_endpoint, timeout="120s")
            count = 0
            if "template" in modes:
                for i, (row, keys) in enumerate(rows.items()):
                    write(config, work, args.accel, True, keys, known)
                    one_pod(ctd, crictl, work, f"w{i}", 0, str(keys.get(RUNTIME, "podvm")))
                    print(f"template made: {row}", flush=True)
            for rnd in range(args.rounds):
                order = list(rows.items())
                for row, keys in order if rnd % 2 == 0 else reversed(order):
                    for mode in modes if rnd % 2 == 0 else reversed(modes):
                        write(config, work, args.accel, mode == "template", keys, known)
                        count += 1
                        s = one_pod(ctd, crictl, work, f"p{count}", args.settle,
                                    str(keys.get(RUNTIME, "podvm")))
                        samples[(row, mode)].append(s)
                        print(f"round {rnd} {mode:8} {row}: ready {s.ready_s:.2f} s, "
                              f"QEMU CPU {s.cpu_s:.2f} s, "
                              f"charged {s.charged_mib:.0f} MiB, QEMU RSS "
                              f"{s.qemu_rss_mib:.0f} MiB", flush=True)
    return samples


def spread(values: list[float], digits: int) -> str:
    med = statistics.median(values)
    return f"{med:.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def report(samples: dict[tuple[str, str], list[Sample]], args: argparse.Namespace) -> None:
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"\n{args.rounds} pods per row, accel={args.accel}, idle {args.settle:g} s before "
          f"the memory is read; median (min-max); {when}, load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print("| configuration | pods | runp to ready s | QEMU CPU to ready s | vs fast line "
          "(CPU) | charged MiB | QEMU RSS MiB |\n|---|---|---|---|---|---|---|")
    fast = "fast line (guest_kernel_hardening = false)"
    for (row, mode), got in samples.items():
        cpu = [s.cpu_s for s in got]
        base = samples.get((fast, mode))
        delta = statistics.median(cpu) - statistics.median(s.cpu_s for s in base) \
            if base else 0.0
        print(f"| {row.strip()} | {mode} | {spread([s.ready_s for s in got], 2)} | "
              f"{spread(cpu, 2)} | {delta:+.2f} | "
              f"{spread([s.charged_mib for s in got], 0)} | "
              f"{spread([s.qemu_rss_mib for s in got], 0)} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="pods per configuration and mode")
    parser.add_argument("--settle", type=float, default=4.0,
                        help="seconds an idle pod runs before its memory is read")
    parser.add_argument("--accel", default="tcg")
    parser.add_argument("--bzimage", default="", metavar="VMLINUZ",
                        help="also the guest's kernel as Debian ships it (the vmlinuz of "
                             "build/guest/manifest.json's release), booted through its "
                             "decompressor: the one boot path where KASLR takes effect")
    parser.add_argument("--only", choices=("boot", "template"), default="",
                        help="only pods that boot, or only pods that restore a template")
    parser.add_argument("--before-tree", default="", metavar="DIR",
                        help="a row whose pods run the shim of this other checkout")
    parser.add_argument("--rows", choices=("all", "jail"), default="all",
                        help="jail: only --before-tree's row and the defaults")
    args = parser.parse_args()
    report(run(args), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
