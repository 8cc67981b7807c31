"""The pod's namespace holder (guest/agent/holder.py) on this machine's kernel, with the
busybox the guest runs: one spawned ahead is the one a pod gets, named as it asks; a pod
after it, or one whose holder ahead died, gets one spawned then; a hostname that is not
one is refused before anything is named. In a real guest through the CRI:
tests/e2e/test_conformance.py (hostname, sysctls) and tests/e2e/test_templates.py."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess

import pytest

from guest.agent import holder
from guest.agent.reaper import REAPER
from podvm_core.ttrpc import Code, TtrpcError
from testbed.prereqs import require_root, require_tool


@pytest.fixture
async def agent(tmp_path, monkeypatch):
    """PID 1's reaping, as the agent has it, for this test's children only; the holders'
    cgroups in a scratch directory."""
    require_root()
    require_tool("busybox", "busybox-static")
    monkeypatch.setattr(holder, "BUSYBOX", "/bin/busybox")
    monkeypatch.setattr(holder, "CGROUP", str(tmp_path / "cgroup"))
    monkeypatch.setattr(holder, "_ahead", None)
    REAPER.install()
    held: list = []
    try:
        yield held
    finally:
        for proc in held:
            if not proc.exited.is_set():
                holder.signal(proc, signal.SIGKILL)
                await asyncio.wait_for(proc.exited.wait(), 10)
        ahead = holder._take_ahead()
        if ahead is not None:
            ahead.discard()
            await asyncio.wait_for(ahead.exit_watch, 10)
        asyncio.get_running_loop().remove_signal_handler(signal.SIGCHLD)


def uts_hostname(pid: int) -> str:
    return subprocess.run(["nsenter", "-t", str(pid), "-u", "/bin/busybox", "hostname"],
                          capture_output=True, text=True, check=True).stdout.strip()


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


async def test_the_holder_spawned_ahead_is_the_pod_s_named_as_it_asks(agent) -> None:
    await holder.prepare()
    ahead = holder._ahead
    assert ahead is not None
    proc = await holder.start("pod-a", "web-0")
    agent.append(proc)
    assert parent_of(proc.pid) == ahead.parent, "the holder spawned ahead, not a new one"
    assert uts_hostname(proc.pid) == "web-0"
    assert os.readlink(f"/proc/{proc.pid}/ns/uts") != os.readlink("/proc/self/ns/uts")
    assert os.readlink(f"/proc/{proc.pid}/ns/pid") != os.readlink("/proc/self/ns/pid")
    # the next pod's namespaces: a holder spawned for it, the guest's hostname kept
    other = await holder.start("pod-b", "")
    agent.append(other)
    assert parent_of(other.pid) != ahead.parent
    assert uts_hostname(other.pid) == uts_hostname(os.getpid())
    assert os.readlink(f"/proc/{other.pid}/ns/uts") != os.readlink(f"/proc/{proc.pid}/ns/uts")
    holder.signal(proc, signal.SIGTERM)
    await asyncio.wait_for(proc.exited.wait(), 10)
    assert proc.exit_status == 128 + signal.SIGTERM


async def test_a_holder_ahead_that_died_is_replaced(agent) -> None:
    await holder.prepare()
    ahead = holder._ahead
    assert ahead is not None
    os.kill(ahead.parent, signal.SIGKILL)
    await asyncio.wait_for(ahead.exit_watch, 10)
    proc = await holder.start("pod-c", "db-1")
    agent.append(proc)
    assert parent_of(proc.pid) != ahead.parent
    assert uts_hostname(proc.pid) == "db-1"


@pytest.mark.parametrize("name", ["a" * 65, "web\n0", "web\x000"])
async def test_a_hostname_that_is_not_one_is_refused_and_the_holder_ahead_kept(
        agent, name) -> None:
    await holder.prepare()
    ahead = holder._ahead
    with pytest.raises(TtrpcError) as err:
        await holder.start("pod-d", name)
    assert err.value.code == Code.INVALID_ARGUMENT and "is not a hostname" in err.value.message
    assert holder._ahead is ahead and not ahead.exit_watch.done()


def children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


async def test_a_holder_ahead_waits_on_its_sleep_already_and_still_reaps_orphans(
        agent) -> None:
    """The sleep the holder waits on is started before the pod comes (a template's
    holder has it), without the holder's pipes; naming the pod starts no process; an
    orphan of the pod's pid namespace is reaped by the holder."""
    await holder.prepare()
    ahead = holder._ahead
    assert ahead is not None
    [shell] = children(ahead.parent)
    [sleep] = children(shell)  # forked before the shell said it is up
    async with asyncio.timeout(10):  # its exec, on a loaded machine
        while open(f"/proc/{sleep}/cmdline", "rb").read().split(b"\0")[1:2] != [b"sleep"]:
            await asyncio.sleep(0.01)
    assert os.readlink(f"/proc/{sleep}/fd/0") == "/dev/null"
    assert not os.path.exists(f"/proc/{sleep}/fd/{holder.READY_FD}")
    proc = await holder.start("pod-e", "web-1")
    agent.append(proc)
    assert proc.pid == shell
    await asyncio.sleep(0.2)
    assert children(shell) == [sleep], "naming the pod started a process"
    # An orphan in the pod's pid namespace: its parent exits at once, it 2 s later.
    subprocess.run(["nsenter", "-t", str(shell), "-p", "/bin/busybox", "sh", "-c",
                    "/bin/busybox sleep 2 & exit 0"], check=True, timeout=10)
    async with asyncio.timeout(10):
        while len(children(shell)) < 2:  # reparented to the holder...
            await asyncio.sleep(0.01)
        while children(shell) != [sleep]:  # ...and reaped once it exits, no zombie left
            await asyncio.sleep(0.05)
