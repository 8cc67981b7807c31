"""A signal to a container's processes without a runc process (guest/agent/kill.py): the
init by its pid, SIGKILL to all through the container's cgroup.kill, anything else to all
through `runc kill --all`, as before. (The guest's real cgroup.kill is played by the e2e
tests' stops; here its file stands in.)"""
from __future__ import annotations

import signal
import subprocess

import pytest

from guest.agent import kill, runc

CID = "kill-test"


@pytest.fixture
def ran(monkeypatch) -> list[tuple[str, ...]]:
    calls: list[tuple[str, ...]] = []

    async def fake(container_id: str, *args: str, **_: object) -> bytes:
        calls.append(args)
        return b""

    monkeypatch.setattr(runc, "runc", fake)
    return calls


async def test_the_init_is_signalled_by_its_pid_without_runc(ran) -> None:
    init = subprocess.Popen(["sleep", "60"])
    try:
        await kill.signal_container(CID, init.pid, signal.SIGTERM, every=False)
        assert init.wait(10) == -signal.SIGTERM
    finally:
        init.kill()
        init.wait()
    assert ran == []
    with pytest.raises(ProcessLookupError):  # reaped: the agent says "already finished"
        await kill.signal_container(CID, init.pid, signal.SIGTERM, every=False)


async def test_sigkill_to_all_is_one_write_to_the_cgroup(ran, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(kill, "CGROUP_ROOT", str(tmp_path))
    cgroup = tmp_path / "podvm" / CID
    cgroup.mkdir(parents=True)
    (cgroup / "cgroup.kill").write_text("")
    await kill.signal_container(CID, 0, signal.SIGKILL, every=True)
    assert (cgroup / "cgroup.kill").read_text() == "1" and ran == []


async def test_runc_still_does_what_the_cgroup_cannot(ran, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(kill, "CGROUP_ROOT", str(tmp_path))  # no cgroup: gone, or v1
    await kill.signal_container(CID, 0, signal.SIGKILL, every=True)
    await kill.signal_container(CID, 0, signal.SIGTERM, every=True)  # each process
    assert ran == [("kill", "--all", CID, "9"), ("kill", "--all", CID, "15")]
    (tmp_path / "podvm" / CID).mkdir(parents=True)
    (tmp_path / "podvm" / CID / "cgroup.kill").symlink_to(tmp_path / "elsewhere")
    await kill.signal_container(CID, 0, signal.SIGKILL, every=True)  # never followed
    assert not (tmp_path / "elsewhere").exists() and len(ran) == 3


async def test_an_exited_container_is_removed_as_runc_would(ran, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(kill, "CGROUP_ROOT", str(tmp_path / "cgroup"))
    monkeypatch.setattr(runc, "ROOT", str(tmp_path / "runc"))
    cgroup = tmp_path / "cgroup" / "podvm" / CID
    cgroup.mkdir(parents=True)  # empty: its processes gone
    (tmp_path / "runc" / CID).mkdir(parents=True)
    (tmp_path / "runc" / CID / "state.json").write_text("{}")
    assert await kill.remove_exited(CID)
    assert not cgroup.exists() and not (tmp_path / "runc" / CID).exists() and ran == []


async def test_a_cgroup_that_will_not_go_is_left_to_runc(ran, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(kill, "CGROUP_ROOT", str(tmp_path / "cgroup"))
    monkeypatch.setattr(runc, "ROOT", str(tmp_path / "runc"))
    (tmp_path / "cgroup" / "podvm" / CID / "its-own").mkdir(parents=True)
    (tmp_path / "runc" / CID).mkdir(parents=True)
    assert not await kill.remove_exited(CID, wait=0.05)
    assert (tmp_path / "runc" / CID).exists()  # runc's state kept for `runc delete`
