"""The table both reservation benches print (bench/reservation.py with bare cgroups,
bench/reservation_vms.py with podvm pods), and the JSON document the chart is drawn from.

A run measures each setting R times, interleaved; a cell is the median over the
repetitions with their range, "median [min-max]" (just the median when R = 1). A column
"vs alone" divides a setting's median by the median of the `alone` setting."""
from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass
from typing import Iterable, Mapping, Sequence

SCHEMA = "podvm-reservation/1"


@dataclass(frozen=True)
class Column:
    key: str
    """The figure's name in each repetition's result."""
    title: str
    digits: int = 2
    vs_alone: bool = False
    """Also print this figure's median relative to `alone`'s."""


@dataclass(frozen=True)
class Summary:
    median: float
    low: float
    high: float
    count: int

    def text(self, digits: int) -> str:
        if self.count == 1 or self.low == self.high:
            return f"{self.median:.{digits}f}"
        return f"{self.median:.{digits}f} [{self.low:.{digits}f}-{self.high:.{digits}f}]"


def summarize(values: Iterable[float]) -> Summary:
    got = sorted(values)
    if not got:
        raise ValueError("no value to summarize")
    return Summary(statistics.median(got), got[0], got[-1], len(got))


def interleaved(settings: Sequence[str], repeat: int) -> list[tuple[int, str]]:
    """(repetition, setting) in running order: every setting once per round, the order
    rotated each round so that no setting always runs first (a machine warming up, or
    someone else's load, then weighs on all of them alike)."""
    if repeat < 1 or not settings:
        raise ValueError(f"at least one setting and one repetition, not {repeat}")
    order = []
    for rep in range(repeat):
        shift = rep % len(settings)
        order += [(rep, s) for s in list(settings[shift:]) + list(settings[:shift])]
    return order


def by_setting(results: Iterable[Mapping], columns: Sequence[Column]
               ) -> dict[str, dict[str, Summary]]:
    """Setting -> column key -> summary, settings in the order they first ran."""
    values: dict[str, dict[str, list[float]]] = {}
    for r in results:
        row = values.setdefault(r["setting"], {})
        for c in columns:
            if r.get(c.key) is not None:
                row.setdefault(c.key, []).append(float(r[c.key]))
    return {s: {k: summarize(v) for k, v in row.items()} for s, row in values.items()}


def table(results: Sequence[Mapping], columns: Sequence[Column]) -> str:
    """A Markdown table (readable as it is in a terminal): one row per setting."""
    summaries = by_setting(results, columns)
    alone = summaries.get("alone", {})
    titles = ["setting"]
    for c in columns:
        titles.append(c.title)
        if c.vs_alone:
            titles.append("vs alone")
    lines = ["| " + " | ".join(titles) + " |", "|" + "---|" * len(titles)]
    for setting, row in summaries.items():
        cells = [setting]
        for c in columns:
            s = row.get(c.key)
            cells.append(s.text(c.digits) if s else "-")
            if c.vs_alone:
                base = alone.get(c.key)
                cells.append(f"{s.median / base.median:.2f}x" if s and base and base.median
                             else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def document(machine: Mapping, parameters: Mapping, columns: Sequence[Column],
             results: Sequence[Mapping]) -> dict:
    """What --json writes: the machine, the parameters, each repetition's figures, and
    the summaries the table shows."""
    return {"schema": SCHEMA, "machine": dict(machine), "parameters": dict(parameters),
            "columns": [asdict(c) for c in columns], "results": list(results),
            "summary": {s: {k: asdict(v) for k, v in row.items()}
                        for s, row in by_setting(results, columns).items()}}


def write_json(path: str, doc: Mapping) -> None:
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
