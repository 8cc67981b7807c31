"""The webhook's Prometheus metrics, in the text exposition format (version 0.0.4):
admissions by endpoint and verdict, their latency as a histogram, certificate reloads."""
from __future__ import annotations

import bisect
from collections import Counter

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
"""Seconds: the API server's webhook timeout is a few seconds; most answers take ~1 ms."""
VERDICTS = ("patched", "allowed", "ignored", "refused", "invalid")
"""patched/allowed: a podvm pod admitted with/without a patch; ignored: another runtime
class; refused: a podvm pod refused; invalid: a request that is not a Pod review."""


class Metrics:
    def __init__(self) -> None:
        self.requests: Counter[tuple[str, str]] = Counter()
        self.buckets = [0] * len(BUCKETS)
        self.latency_sum = 0.0
        self.latency_count = 0
        self.reloads: Counter[str] = Counter()

    def observe(self, endpoint: str, verdict: str, seconds: float) -> None:
        assert verdict in VERDICTS, verdict
        self.requests[(endpoint, verdict)] += 1
        index = bisect.bisect_left(BUCKETS, seconds)
        if index < len(self.buckets):
            self.buckets[index] += 1
        self.latency_sum += seconds
        self.latency_count += 1

    def reloaded(self, ok: bool) -> None:
        self.reloads["success" if ok else "failure"] += 1

    def render(self) -> str:
        lines = ["# HELP podvm_webhook_requests_total Admission reviews answered, by "
                 "endpoint and verdict.",
                 "# TYPE podvm_webhook_requests_total counter"]
        lines += [f'podvm_webhook_requests_total{{endpoint="{e}",verdict="{v}"}} {n}'
                  for (e, v), n in sorted(self.requests.items())]
        lines += ["# HELP podvm_webhook_admission_duration_seconds Time to answer an "
                  "admission review, its body's read included.",
                  "# TYPE podvm_webhook_admission_duration_seconds histogram"]
        cumulative = 0
        for bound, count in zip(BUCKETS, self.buckets):
            cumulative += count
            lines.append(f'podvm_webhook_admission_duration_seconds_bucket{{le="{bound}"}} '
                         f"{cumulative}")
        lines += [f'podvm_webhook_admission_duration_seconds_bucket{{le="+Inf"}} '
                  f"{self.latency_count}",
                  f"podvm_webhook_admission_duration_seconds_sum {self.latency_sum:.6f}",
                  f"podvm_webhook_admission_duration_seconds_count {self.latency_count}",
                  "# HELP podvm_webhook_certificate_reloads_total Certificate and key "
                  "reloads after they changed on disk, by result.",
                  "# TYPE podvm_webhook_certificate_reloads_total counter"]
        lines += [f'podvm_webhook_certificate_reloads_total{{result="{r}"}} {self.reloads[r]}'
                  for r in ("success", "failure")]
        return "\n".join(lines) + "\n"
