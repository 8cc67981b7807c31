"""OOM kills as the guest tells them, at a rate the guest cannot raise.

The agent's GetOOMEvent is a long poll: each answer names one container. A hostile guest
can answer at once, forever; so the watcher takes a token of the pod's bucket before it
asks again. Above the rate, what the guest has to say waits in the guest (its memory,
not the host's), and the host asks, logs and publishes at most OOM_RATE events a second
(OOM_BURST at once). Which container an event names is the guest's word: the listener
checks it is one of the pod's (shim/api/task/reporting.py)."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable

from podvm_core.ttrpc import TtrpcError

from podvm_core.ratelimit import TokenBucket

if TYPE_CHECKING:
    from ..vm.agent import Agent

log = logging.getLogger("podvm.pod")

OOM_RATE = 5.0
"""OOM events a second, steady: a real guest tells one per container per kill (it merges
the kills a container had since it last told, guest/agent/oom.py), so a pod that has
this many containers killed each second is already beyond help."""
OOM_BURST = 20


def oom_bucket() -> TokenBucket:
    """A pod's own: one pod's guest cannot slow another's events."""
    return TokenBucket(OOM_RATE, OOM_BURST)


async def watch_oom(agent: "Agent", sandbox_id: str, bucket: TokenBucket,
                    tell: Callable[[str], None]) -> None:
    """Until the agent's connection ends: each container the guest names, to `tell`."""
    while True:
        await bucket.take()
        try:
            container_id = await agent.oom_event()
        except TtrpcError as exc:
            log.debug("OOM watch of sandbox %s ended: %s", sandbox_id, exc)
            return
        tell(container_id)
