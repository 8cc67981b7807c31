"""The agent hears of an OOM kill when the kernel changes the container cgroup's
memory.events (inotify), with no poll running: a kill is told once, in order, and a
kill told with the exit is not told again. A regular file stands in for memory.events
(cgroup v2 reports its changes as the same IN_MODIFY)."""
from __future__ import annotations

import asyncio
import pathlib

import pytest

from guest.agent import resources
from guest.agent.oom import OOMKills


def _events(cgroup: pathlib.Path, container_id: str, kills: int) -> None:
    (cgroup / container_id).mkdir(exist_ok=True)
    (cgroup / container_id / "memory.events").write_text(
        f"low 0\nhigh 0\nmax 3\noom 1\noom_kill {kills}\n")


async def _next(kills: OOMKills) -> str:
    return await asyncio.wait_for(kills.next(), 5)


@pytest.fixture
def cgroup(tmp_path, monkeypatch) -> pathlib.Path:
    """The agent's cgroup root, for these tests a plain directory."""
    monkeypatch.setattr(resources, "CGROUP", str(tmp_path))
    return tmp_path


async def test_kills_are_told_as_memory_events_change(cgroup) -> None:
    kills = OOMKills()
    _events(cgroup, "a", 0)
    _events(cgroup, "b", 0)
    kills.watch("a")
    kills.watch("b")
    kills.watch("holder")  # no cgroup of its own: nothing to watch
    _events(cgroup, "b", 1)
    assert await _next(kills) == "b"
    _events(cgroup, "a", 2)
    assert await _next(kills) == "a"
    _events(cgroup, "a", 2)  # a change that is no new kill
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(kills.next(), 0.5)


async def test_a_kill_before_the_watch_is_counted(cgroup) -> None:
    kills = OOMKills()
    _events(cgroup, "a", 1)
    kills.watch("a")
    assert await _next(kills) == "a"


async def test_a_kill_told_at_exit_is_not_told_again(cgroup) -> None:
    kills = OOMKills()
    _events(cgroup, "a", 0)
    kills.watch("a")
    (cgroup / "a" / "memory.events").write_text("oom_kill 1\n")
    assert kills.take_at_exit("a")  # before the notification is read
    await asyncio.sleep(0.2)  # the notification comes and finds nothing new
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(kills.next(), 0.5)
    kills.forget("a")
    _events(cgroup, "a", 0)  # the id comes again, with a new cgroup
    kills.watch("a")
    _events(cgroup, "a", 1)
    assert await _next(kills) == "a"
