"""How long the host waited for its guest (shim/vm/guestclock.py), as the agent's client
counts it: the calls' waits, overlapping ones once, the long polls and the flows not at
all. bench/pod_bench.py takes the host's share of a pod's start as its wall time less
this, so a clock that counted the polls (always in flight) would call everything the
guest's."""
from __future__ import annotations

import asyncio

from podvm_core.ttrpc import Code, TtrpcError
from shim.vm import agent as agent_module
from shim.vm.agent import Agent
from shim.vm.guestclock import GuestClock


class SlowClient:
    """Answers each call after `delay` seconds; a long poll's window ends with nothing."""

    closed = False

    def __init__(self, delay: float) -> None:
        self.delay = delay

    async def call(self, service, method, request, response, timeout, grace):
        await asyncio.sleep(self.delay)
        if method in ("WaitProcess", "GetOOMEvent"):
            raise TtrpcError(Code.DEADLINE_EXCEEDED, "the window ended")
        return response()


async def test_overlapping_waits_count_once_and_a_failed_call_counts_too() -> None:
    clock = GuestClock()
    assert clock.seconds() == 0.0

    async def wait(seconds: float, fail: bool = False) -> None:
        with clock.waiting():
            await asyncio.sleep(seconds)
            if fail:
                raise RuntimeError("the guest said no")

    await asyncio.gather(wait(0.2), wait(0.1), return_exceptions=True)
    first = clock.seconds()
    assert 0.19 <= first < 0.29  # the two at once: 0.2, not 0.3
    await asyncio.gather(wait(0.1, fail=True), return_exceptions=True)
    assert 0.29 <= clock.seconds() < 0.39
    with clock.waiting():  # one in flight counts as it goes
        await asyncio.sleep(0.05)
        assert clock.seconds() >= 0.34


async def test_the_agent_counts_its_calls_but_not_its_long_polls(monkeypatch) -> None:
    monkeypatch.setattr(agent_module, "POLL_PACE", 0.0)
    agent = Agent(SlowClient(0.1), "sb")  # type: ignore[arg-type]
    await agent.ping()
    assert 0.09 <= agent.clock.seconds() < 0.19
    before = agent.clock.seconds()
    waiting = asyncio.ensure_future(agent.wait("c1", ""))  # a container's exit, polled
    await asyncio.sleep(0.35)
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    assert agent.clock.seconds() == before
