"""Rates a guest cannot raise: a token bucket that paces what the shim does for a guest
(shim/pod/guestevents.py asks for OOM events no faster than it allows), and a log line
that is written at most once per interval whatever the guest makes happen, with the
count of what it stood for (a guest naming other pods' containers, events dropped)."""
from __future__ import annotations

import asyncio
import logging
import time


class TokenBucket:
    """`rate` tokens a second, at most `burst` kept: `take()` waits for one. Waiting
    paces the caller (and through it the guest) without blocking the event loop, and
    costs no memory: nothing is queued here."""

    def __init__(self, rate: float, burst: int) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError(f"a token bucket needs a positive rate and burst, got "
                             f"{rate}/s, {burst}")
        self.rate, self.burst = rate, burst
        self._tokens = float(burst)
        self._at = time.monotonic()

    def _refill(self) -> None:
        now = time.monotonic()
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._at = now

    def try_take(self) -> bool:
        """A token now, or False."""
        self._refill()
        if self._tokens >= 1:
            self._tokens -= 1
            return True
        return False

    async def take(self) -> None:
        while not self.try_take():
            await asyncio.sleep((1 - self._tokens) / self.rate)


class LimitedLog:
    """One warning per `interval` seconds at most; the occurrences in between are
    counted and said with the next line written."""

    def __init__(self, logger: logging.Logger, interval: float = 10.0) -> None:
        self._log = logger
        self._interval = interval
        self._next = 0.0
        self.count = 0
        """Occurrences in all (written or not)."""
        self._unsaid = 0

    def warning(self, message: str, *args: object) -> None:
        self.count += 1
        self._unsaid += 1
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self._interval
        suffix = f" ({self._unsaid - 1} more since the last such line)" if self._unsaid > 1 else ""
        self._unsaid = 0
        self._log.warning(message + suffix, *args)
