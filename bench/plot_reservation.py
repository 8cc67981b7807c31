"""Draw a reservation bench's --json output (bench/reservation_vms.py or
bench/reservation.py) as a PNG: one bar chart per figure of the table, a bar per
setting at the median, error bars from the lowest to the highest repetition.

usage: python bench/plot_reservation.py RESULTS.json OUT.png [--title TEXT]
(matplotlib: pip install -e '.[bench]')
"""
from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys

SCHEMA = "podvm-reservation/1"
COLOURS = {"alone": "#8c8c8c", "shares": "#d62728", "quota": "#ff7f0e",
           "exclusive": "#2ca02c"}


def load(path: pathlib.Path) -> dict:
    doc = json.loads(path.read_text())
    if doc.get("schema") != SCHEMA:
        raise ValueError(f"{path}: not a reservation bench's --json output (schema "
                         f"{doc.get('schema')!r}, expected {SCHEMA!r})")
    return doc


def subtitle(doc: dict) -> str:
    m, p = doc["machine"], doc["parameters"]
    parts = [f"{m.get('cpus')} CPUs", m.get("model", ""), f"cgroup v{m.get('cgroup')}"]
    if "accel" in m:
        parts.append(f"accel={m['accel']}")
    parts.append(f"R={p.get('repeat')}, {p.get('seconds')} s per workload")
    return ", ".join(str(x) for x in parts if x)


def plot(doc: dict, out: pathlib.Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = doc["summary"]
    settings = list(summary)
    columns = [c for c in doc["columns"] if any(c["key"] in summary[s] for s in settings)]
    if not columns:
        raise ValueError("the results hold no figure to draw")
    cols = min(4, len(columns))
    rows = math.ceil(len(columns) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.4 * cols, 3.0 * rows + 0.8),
                             squeeze=False)
    for ax, column in zip(axes.flat, columns):
        have = [s for s in settings if column["key"] in summary[s]]
        cells = [summary[s][column["key"]] for s in have]
        medians = [c["median"] for c in cells]
        errors = [[c["median"] - c["low"] for c in cells],
                  [c["high"] - c["median"] for c in cells]]
        ax.bar(have, medians, yerr=errors, capsize=4,
               color=[COLOURS.get(s, "#1f77b4") for s in have])
        ax.set_title(column["title"], fontsize=10)
        ax.tick_params(axis="x", labelrotation=30, labelsize=8)
        ax.tick_params(axis="y", labelsize=8)
    for ax in list(axes.flat)[len(columns):]:
        ax.set_visible(False)
    fig.suptitle(f"{title}\n{subtitle(doc)}", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    intro, _, details = (__doc__ or "").partition("\n\n")
    p = argparse.ArgumentParser(description=intro, epilog=details,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", type=pathlib.Path, help="a reservation bench's --json file")
    p.add_argument("out", type=pathlib.Path, help="the PNG to write")
    p.add_argument("--title", default="Mind the Gap with podvm pods: the target pod's "
                   "figures (median, range over repetitions)")
    args = p.parse_args(argv)
    try:
        plot(load(args.results), args.out, args.title)
    except (OSError, ValueError, KeyError) as exc:
        print(f"plot_reservation.py: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
