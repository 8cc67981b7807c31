"""bench/reservation_table.py: the reservation benches' table and JSON, as a reader of
docs/benchmarks.md or of the chart sees them."""
from __future__ import annotations

import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest

from testbed.prereqs import require

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import reservation_table  # noqa: E402
from reservation_table import Column  # noqa: E402

COLUMNS = (Column("cpu", "CPU recv/req", vs_alone=True), Column("p99", "p99 ms", digits=1))


def results() -> list[dict]:
    return [{"setting": "alone", "cpu": 1.0, "p99": 2.0},
            {"setting": "shares", "cpu": 0.5, "p99": 9.0},
            {"setting": "alone", "cpu": 0.9, "p99": 4.0},
            {"setting": "shares", "cpu": 0.7, "p99": 5.0},
            {"setting": "alone", "cpu": 0.8, "p99": 3.0},
            {"setting": "shares", "cpu": 0.6, "p99": None}]


def test_each_round_runs_every_setting_in_a_rotated_order() -> None:
    order = reservation_table.interleaved(["a", "b", "c"], 3)
    assert order == [(0, "a"), (0, "b"), (0, "c"), (1, "b"), (1, "c"), (1, "a"),
                     (2, "c"), (2, "a"), (2, "b")]
    with pytest.raises(ValueError):
        reservation_table.interleaved(["a"], 0)


def test_a_cell_is_the_median_with_the_range() -> None:
    lines = reservation_table.table(results(), COLUMNS).splitlines()
    assert lines[0] == "| setting | CPU recv/req | vs alone | p99 ms |"
    assert lines[2] == "| alone | 0.90 [0.80-1.00] | 1.00x | 3.0 [2.0-4.0] |"
    # A figure missing from one repetition: the others' median and range.
    assert lines[3] == "| shares | 0.60 [0.50-0.70] | 0.67x | 7.0 [5.0-9.0] |"


def test_one_repetition_prints_the_figure_alone() -> None:
    table = reservation_table.table([{"setting": "shares", "cpu": 0.5, "p99": 1.0}], COLUMNS)
    assert table.splitlines()[2] == "| shares | 0.50 | - | 1.0 |"  # no alone: no ratio


def test_json_holds_every_repetition_and_the_summaries(tmp_path) -> None:
    doc = reservation_table.document({"cpus": 2}, {"repeat": 3}, COLUMNS, results())
    path = tmp_path / "r.json"
    reservation_table.write_json(str(path), doc)
    back = json.loads(path.read_text())
    assert back["schema"] == reservation_table.SCHEMA and len(back["results"]) == 6
    assert back["summary"]["shares"]["cpu"] == {"median": 0.6, "low": 0.5, "high": 0.7,
                                               "count": 3}
    assert [c["key"] for c in back["columns"]] == ["cpu", "p99"]


def test_the_chart_is_drawn_from_the_json(tmp_path) -> None:
    require(importlib.util.find_spec("matplotlib") is not None,
            "matplotlib (pip install -e '.[bench]')")
    doc = reservation_table.document({"cpus": 2}, {"repeat": 3, "seconds": 1}, COLUMNS,
                                     results())
    source, png = tmp_path / "r.json", tmp_path / "r.png"
    reservation_table.write_json(str(source), doc)
    done = subprocess.run([sys.executable, str(ROOT / "bench/plot_reservation.py"),
                           str(source), str(png)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    source.write_text(json.dumps({"schema": "other"}))
    done = subprocess.run([sys.executable, str(ROOT / "bench/plot_reservation.py"),
                           str(source), str(png)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "not a reservation bench's --json output" in done.stderr
