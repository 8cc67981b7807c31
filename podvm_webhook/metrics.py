"""The webhook's Prometheus metrics (prometheus_client, in a registry of the server's own,
never the library's global one, so that two servers in one process count apart):
admissions by endpoint and verdict, their latency as a histogram, certificate reloads."""
from __future__ import annotations

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram,
                               generate_latest)

CONTENT_TYPE = CONTENT_TYPE_LATEST
BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
"""Seconds: the API server's webhook timeout is a few seconds; most answers take ~1 ms."""
VERDICTS = ("patched", "allowed", "ignored", "refused", "invalid")
"""patched/allowed: a podvm pod admitted with/without a patch; ignored: another runtime
class; refused: a podvm pod refused; invalid: a request that is not a Pod review."""
RELOADS = ("success", "failure")


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("podvm_webhook_requests", "Admission reviews answered, by "
                                "endpoint and verdict.", ("endpoint", "verdict"),
                                registry=self.registry)
        self.latency = Histogram("podvm_webhook_admission_duration_seconds",
                                 "Time to answer an admission review, its body's read "
                                 "included.", buckets=BUCKETS, registry=self.registry)
        self.reloads = Counter("podvm_webhook_certificate_reloads", "Certificate and key "
                               "reloads after they changed on disk, by result.", ("result",),
                               registry=self.registry)
        for result in RELOADS:  # both shown from the start, at 0
            self.reloads.labels(result)

    def observe(self, endpoint: str, verdict: str, seconds: float) -> None:
        assert verdict in VERDICTS, verdict
        self.requests.labels(endpoint, verdict).inc()
        self.latency.observe(seconds)

    def reloaded(self, ok: bool) -> None:
        self.reloads.labels(RELOADS[0] if ok else RELOADS[1]).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
