"""Every operation in every state: legal ones move as containerd's runc shim does,
illegal ones answer a code and change nothing."""
from __future__ import annotations

import pytest

from shim.task.process import LIVE_ONLY, TRANSITIONS, Process, State
from shim.ttrpc import Code, TtrpcError

OPERATIONS = sorted(set(TRANSITIONS) | set(LIVE_ONLY))

EXPECTED = {
    ("start", State.CREATED): State.RUNNING,
    ("pause", State.RUNNING): State.PAUSED,
    ("resume", State.PAUSED): State.RUNNING,
    ("exit", State.CREATED): State.STOPPED,
    ("exit", State.RUNNING): State.STOPPED,
    ("exit", State.PAUSED): State.STOPPED,
    ("delete", State.CREATED): State.DELETED,
    ("delete", State.STOPPED): State.DELETED,
    ("kill", State.CREATED): State.CREATED,
    ("kill", State.RUNNING): State.RUNNING,
    ("kill", State.PAUSED): State.PAUSED,
    ("exec", State.RUNNING): State.RUNNING,
    ("update", State.CREATED): State.CREATED,
    ("update", State.RUNNING): State.RUNNING,
    ("update", State.PAUSED): State.PAUSED,
    ("resize", State.CREATED): State.CREATED,
    ("resize", State.RUNNING): State.RUNNING,
    ("resize", State.PAUSED): State.PAUSED,
    ("closeio", State.CREATED): State.CREATED,
    ("closeio", State.RUNNING): State.RUNNING,
    ("closeio", State.PAUSED): State.PAUSED,
}


@pytest.mark.parametrize("state", list(State))
@pytest.mark.parametrize("operation", OPERATIONS)
def test_operation_in_state(operation: str, state: State) -> None:
    proc = Process("c1", state=state)
    if (operation, state) in EXPECTED:
        proc.transition(operation)
        assert proc.state is EXPECTED[(operation, state)]
        return
    with pytest.raises(TtrpcError) as err:
        proc.transition(operation)
    assert proc.state is state
    if operation == "kill" and state is State.STOPPED:
        assert err.value.code == Code.NOT_FOUND  # containerd treats it as already gone
    else:
        assert err.value.code == Code.FAILED_PRECONDITION
        assert state.value in err.value.message and "c1" in err.value.message


async def test_wait_returns_the_exit() -> None:
    import asyncio

    proc = Process("c1", exec_id="e1", state=State.RUNNING)
    waiter = asyncio.create_task(proc.wait())
    await asyncio.sleep(0)
    assert not waiter.done()
    proc.set_exited(137, 1_700_000_000_000_000_000)
    assert await waiter == (137, 1_700_000_000_000_000_000)
    assert proc.state is State.STOPPED and proc.state.status == 3  # containerd STOPPED
