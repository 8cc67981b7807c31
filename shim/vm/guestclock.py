"""How long the host waited for its guest: the seconds in which at least one of the
agent's calls was in flight (shim/vm/agent.py), overlapping calls counted once. The long
polls and the stream copies (a process's exit, its output, a port forward's bytes) wait
for the workload, not the guest, and are not counted.

What a pod's start costs the host is its wall time less this: the host's share, which a
node under KVM keeps, where the guest's steps shrink to the hardware's speed
(bench/pod_bench.py prints both; docs/benchmarks.md)."""
from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator


class GuestClock:
    def __init__(self) -> None:
        self._in_flight = 0
        self._since = 0.0
        self._done = 0.0

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Around one call to the guest."""
        if self._in_flight == 0:
            self._since = time.monotonic()
        self._in_flight += 1
        try:
            yield
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._done += time.monotonic() - self._since

    def seconds(self) -> float:
        """Waited so far, the calls in flight included."""
        if self._in_flight:
            return self._done + time.monotonic() - self._since
        return self._done
