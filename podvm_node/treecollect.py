"""`podvm-node trees --host-root DIR [--every SECONDS | --once]`: the install trees
(/opt/podvm/<name>, podvm_core/trees.py) that no process uses any more, removed every
`--every` seconds (podvm_core/treegc.py decides; `current`'s tree always stays).

An upgrade installs the new tree beside the old and leaves the old one to the pods still
running on it; without this, it would stay until the next install. Its own container of
the node DaemonSet (packaging/kubernetes/node.yaml), not the monitor's: it needs the
host's /opt/podvm writable and every process's maps readable (CAP_SYS_PTRACE: a jailed
QEMU runs as a uid of its own), which the monitor, serving HTTP, does without. A process
it may not look into counts as using every tree, so a view too narrow removes nothing."""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from typing import Callable

from podvm_core import treegc, trees

EVERY = 600.0
"""Seconds between collections: a tree is 200 MiB on disk, its pods run for days."""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="podvm-node trees", description=__doc__.split("\n\n")[0])
    p.add_argument("--host-root", required=True,
                   help="where the host's root is mounted (/host in the DaemonSet)")
    when = p.add_mutually_exclusive_group()
    when.add_argument("--every", type=float, default=EVERY,
                      help=f"seconds between collections (default {EVERY:.0f})")
    when.add_argument("--once", action="store_true", help="collect once and exit")
    return p


def collect_once(host: str, say: Callable[[str], None]) -> list[str]:
    """One collection under `host` (its /opt/podvm); the trees removed, each said."""
    if not os.path.isdir(host + trees.PREFIX):
        return []
    removed = treegc.collect(host)
    if removed:
        say(f"removed trees no process uses any more: {', '.join(removed)}")
    return removed


def main(command: str = "trees", argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.every <= 0:
        print("podvm-node trees: --every must be more than 0 seconds", file=sys.stderr)
        return 2
    host = os.path.abspath(args.host_root).rstrip("/")

    def say(line: str) -> None:
        print(f"podvm-node trees: {line}", flush=True)

    if args.once:
        collect_once(host, say)
        return 0
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    say(f"collecting unused trees under {host + trees.PREFIX} every {args.every:.0f}s")
    while not stop.is_set():
        started = time.monotonic()
        try:
            collect_once(host, say)
        except OSError as exc:  # said, and tried again next time
            say(f"collection failed: {exc}")
        stop.wait(max(0.0, args.every - (time.monotonic() - started)))
    return 0
