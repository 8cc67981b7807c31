"""The process state model both the shim and the guest agent keep: every operation in
every state, against a table written here from containerd's runc shim
(pkg/process/init_state.go, deleted_state.go) and docs/design.md, Task API processes, not from the
module: what each legal operation leads to, and the code and words of each refusal."""
from __future__ import annotations

import asyncio
import itertools

import pytest

from podvm_core import procstate
from podvm_core.procstate import (CREATED, DELETED, PAUSED, RUNNING, STOPPED, Lifecycle,
                                  ProcessState, Refused)
from podvm_core.ttrpc import Code, TtrpcError

FP, NF = Code.FAILED_PRECONDITION, Code.NOT_FOUND
WHO = "exec e-1 of container c-9"
STATES = {"created": CREATED, "running": RUNNING, "paused": PAUSED, "stopped": STOPPED,
          "deleted": DELETED}

# operation -> its outcome in created, running, paused, stopped, deleted: the state it
# leads to, or the code it is refused with.
TABLE: dict[str, tuple[str | Code, ...]] = {
    #              created     running    paused     stopped    deleted
    "start":      ("running", FP,        FP,        FP,        NF),
    "delete":     ("deleted", FP,        FP,        "deleted", NF),
    "pause":      (FP,        "paused",  FP,        FP,        NF),
    "resume":     (FP,        FP,        "running", FP,        NF),
    "exec":       (FP,        "running", FP,        FP,        NF),
    "kill":       ("created", "running", "paused",  NF,        NF),
    "kill_all":   ("created", "running", "paused",  "stopped", NF),
    "resize":     ("created", "running", "paused",  FP,        NF),
    "close_io":   ("created", "running", "paused",  FP,        NF),
    "update":     ("created", "running", "paused",  FP,        NF),
    "set_exited": ("stopped", "stopped", "stopped", "stopped", "deleted"),
}
CASES = [(op, state) for op in TABLE for state in STATES]


def expected(operation: str, state: str) -> str | Code:
    return TABLE[operation][list(STATES).index(state)]


def test_the_table_covers_every_operation_and_state() -> None:
    assert set(TABLE) == set(procstate.OPERATIONS)
    assert set(procstate.STATES) == set(STATES.values())
    assert [s.name for s in procstate.STATES] == list(STATES)


@pytest.mark.parametrize("operation,state", CASES, ids=[f"{o}-{s}" for o, s in CASES])
def test_operation_in_state(operation: str, state: str) -> None:
    """A legal operation names its next state (by method and by name alike); an
    illegal one raises a refusal that is a TtrpcError with the code containerd acts
    on and words that name the process and its state."""
    want, current = expected(operation, state), STATES[state]
    if isinstance(want, Code):
        for call in (lambda: current.after(operation, WHO),
                     lambda: getattr(current, operation)(WHO)):
            with pytest.raises(Refused) as err:
                call()
            refusal = err.value
            assert isinstance(refusal, TtrpcError)
            assert refusal.code == want
            assert (refusal.who, refusal.operation, refusal.state) == (WHO, operation, current)
            assert WHO in refusal.message
            if want == FP:
                assert f"it is {state}" in refusal.message
            elif state == "deleted":
                assert "not found" in refusal.message and "deleted" in refusal.message
            else:
                assert refusal.message.endswith("process already finished")
        assert not current.allows(operation)
    else:
        assert current.after(operation, WHO) is STATES[want]
        assert getattr(current, operation)(WHO) is STATES[want]
        assert current.allows(operation)


@pytest.mark.parametrize("state", STATES)
def test_live_means_it_may_still_run(state: str) -> None:
    assert STATES[state].live == (state in ("created", "running", "paused"))


def test_an_unknown_operation_is_a_bug_not_a_refusal() -> None:
    with pytest.raises(ValueError):
        RUNNING.after("checkpoint", WHO)


def test_no_path_leaves_deleted() -> None:
    """Whatever happens after a delete, the process stays deleted."""
    for operations in itertools.product(procstate.OPERATIONS, repeat=2):
        state: ProcessState = DELETED
        for operation in operations:
            if state.allows(operation):
                state = state.after(operation, WHO)
        assert state is DELETED


def test_a_process_is_named_as_containerd_names_it() -> None:
    assert Lifecycle("c-9").name == "container c-9"
    assert Lifecycle("c-9", "e-1").name == WHO


async def test_acting_moves_on_only_when_the_work_succeeds() -> None:
    proc = Lifecycle("c-9")
    with pytest.raises(OSError):
        async with proc.acting("start"):
            raise OSError("runc failed")
    assert proc.state is CREATED
    async with proc.acting("start"):
        assert proc.state is CREATED  # moved after the work, not before
    assert proc.state is RUNNING
    with pytest.raises(Refused) as err:
        async with proc.acting("start"):
            pytest.fail("the work of a refused operation must not run")
    assert err.value.code == FP
    assert proc.state is RUNNING and not proc.lock.locked()


async def test_an_exit_during_the_work_stands() -> None:
    """Pause of a process that exits meanwhile leaves it stopped; Delete of a created
    one that exits meanwhile still deletes it."""
    proc = Lifecycle("c-9", state=RUNNING)
    async with proc.acting("pause"):
        assert proc.set_exited(137, 5)
    assert proc.state is STOPPED
    proc = Lifecycle("c-9")
    async with proc.acting("delete"):
        proc.set_exited(137, 5)
    assert proc.state is DELETED


async def test_one_operation_at_a_time() -> None:
    """Two Starts, two Deletes, a Kill beside a Delete: the second waits for the first
    and is checked against the state the first left."""
    proc = Lifecycle("c-9")
    gate = asyncio.Event()

    async def start() -> None:
        async with proc.acting("start"):
            await gate.wait()

    tasks = [asyncio.create_task(start()) for _ in range(2)]
    await asyncio.sleep(0)
    gate.set()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert sorted(type(r).__name__ for r in results) == ["NoneType", "Refused"]
    assert proc.state is RUNNING

    proc = Lifecycle("c-9", state=RUNNING)
    proc.set_exited(0, 1)

    async def act(operation: str) -> None:
        async with proc.acting(operation):
            await asyncio.sleep(0)

    results = await asyncio.gather(act("delete"), act("kill"), act("delete"),
                                   return_exceptions=True)
    assert results[0] is None
    assert [r.code for r in results[1:]] == [NF, NF]  # type: ignore[union-attr]
    assert proc.state is DELETED


async def test_an_exit_is_recorded_once_and_releases_waiters() -> None:
    proc = Lifecycle("c-9", state=RUNNING)
    waiter = asyncio.create_task(proc.wait())
    await asyncio.sleep(0)
    assert not waiter.done()
    assert proc.set_exited(3, 7) is True
    assert await waiter == (3, 7)
    assert proc.set_exited(9, 8) is False  # no news: the first exit stands
    assert (proc.state, proc.exit_status, proc.exited_at_ns) == (STOPPED, 3, 7)


async def test_an_exit_after_delete_changes_nothing_but_releases_waiters() -> None:
    """runc delete --force of a created container kills it: its exit comes after."""
    proc = Lifecycle("c-9")
    async with proc.acting("delete"):
        pass
    assert proc.set_exited(137, 9) is False
    assert proc.state is DELETED
    assert await proc.wait() == (137, 9)
