"""bench/reservation.py runs, prints its figures and leaves no cgroup behind."""
from __future__ import annotations

import pathlib
import re
import subprocess
import sys

from tests.conftest import require_root

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_reservation_bench_smoke() -> None:
    require_root()
    before = {p.name for p in pathlib.Path("/sys/fs/cgroup/cpu").iterdir()} \
        if pathlib.Path("/sys/fs/cgroup/cpu").is_dir() else set()
    out = subprocess.run([sys.executable, str(ROOT / "bench/reservation.py"), "--seconds",
                          "1"], capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.startswith("machine: ")
    figures = re.findall(r"CPU received / requested\s+([0-9.]+).*p99\s+([0-9.]+) ms", out)
    assert len(figures) == 3 and all(float(cpu) > 0 for cpu, _ in figures)
    after = {p.name for p in pathlib.Path("/sys/fs/cgroup/cpu").iterdir()} \
        if pathlib.Path("/sys/fs/cgroup/cpu").is_dir() else set()
    assert after == before
