"""The whole Task API driven as containerd drives it (ttrpc on the shim's socket, FIFOs
for stdio): what ctr and the CRI do not reach easily — stdin, terminals, pause, pids,
kill --all, bad requests, concurrent calls. What the shim does with them is the host's
and the agent protocol's, so these run on a FakeVM (testbed/fakevm.py: real processes
behind the same agent calls, no guest); the exec probes' count of the guest agent's
open files is the guest's, on a real VM."""
from __future__ import annotations

import asyncio
import json
import os
import pathlib

import pytest

from podvm_core.pb.containerd.task.v2 import shim_pb2 as api
from podvm_core.ttrpc import Code, TtrpcError

from testbed.containerd import mounts_under
from testbed.shimproc import daemon_pid
from testbed.taskshim import NS, Fifos, busybox_rootfs, call, create, task_shim, workload_bundle


@pytest.fixture(scope="module")
def rootfs(tmp_path_factory) -> pathlib.Path:
    return busybox_rootfs(tmp_path_factory.mktemp("busybox-rootfs"))


@pytest.fixture
async def shim(tmp_path, rootfs):
    async with task_shim(tmp_path, rootfs, vmm="fake") as ctx:
        yield ctx


@pytest.fixture
async def vm_shim(tmp_path, rootfs):
    async with task_shim(tmp_path, rootfs) as ctx:
        yield ctx


async def test_stdin_reaches_the_container_and_eof_ends_it(shim) -> None:
    fifos = Fifos(shim["tmp"], "cat", stdin=True)
    await create(shim, "cat", workload_bundle(shim, "cat", args=["cat"]), fifos)
    await call(shim, "Start", api.StartRequest(id="cat"), api.StartResponse)
    writer = os.open(fifos.paths["stdin"], os.O_WRONLY)
    os.write(writer, b"through the VM\n")
    assert b"through the VM\n" in await fifos.read(fifos.out, b"\n")
    os.close(writer)  # end of stdin: cat exits 0
    waited = await call(shim, "Wait", api.WaitRequest(id="cat"), api.WaitResponse)
    assert waited.exit_status == 0
    deleted = await call(shim, "Delete", api.DeleteRequest(id="cat"), api.DeleteResponse)
    assert deleted.exit_status == 0
    expected = ["/tasks/create", "/tasks/start", "/tasks/exit", "/tasks/delete"]
    async with asyncio.timeout(10):  # events are forwarded in order, after the answers
        while len(shim["events"]) < 2 + len(expected):
            await asyncio.sleep(0.05)
    assert [t for t, _ in shim["events"]][2:] == expected  # after the sandbox's two
    assert ("/tasks/exit", "containerd.events.TaskExit") in shim["events"]


async def test_terminal_and_resize(shim) -> None:
    fifos = Fifos(shim["tmp"], "tty")
    script = "stty size; tty -s && echo is-a-tty; sleep 1000"
    await create(shim, "tty", workload_bundle(shim, "tty", args=["sh", "-c", script],
                                              terminal=True), fifos, terminal=True)
    await call(shim, "Start", api.StartRequest(id="tty"), api.StartResponse)
    assert b"is-a-tty" in await fifos.read(fifos.out, b"is-a-tty")
    await call(shim, "ResizePty", api.ResizePtyRequest(id="tty", width=100, height=40))
    with pytest.raises(TtrpcError) as err:  # no terminal on the sandbox
        await call(shim, "ResizePty", api.ResizePtyRequest(id="sb", width=1, height=1))
    assert err.value.code == Code.FAILED_PRECONDITION
    await call(shim, "Kill", api.KillRequest(id="tty", signal=9))
    waited = await call(shim, "Wait", api.WaitRequest(id="tty"), api.WaitResponse)
    assert waited.exit_status == 137
    await call(shim, "Delete", api.DeleteRequest(id="tty"), api.DeleteResponse)


async def test_bad_requests_answer_codes_and_leave_nothing(shim) -> None:
    fifos = Fifos(shim["tmp"], "bad")
    with pytest.raises(TtrpcError) as err:
        await create(shim, "bad", shim["tmp"] / "nonexistent", fifos)
    assert err.value.code == Code.INVALID_ARGUMENT
    bundle = workload_bundle(shim, "bad", args=["/no/such/binary"])
    with pytest.raises(TtrpcError) as err:
        await create(shim, "bad", bundle, fifos)
    assert err.value.code == Code.FAILED_PRECONDITION and "no/such/binary" in err.value.message
    # nothing of it stays mounted in the pod's mount namespace (the daemon's), where
    # the sandbox's rootfs is
    daemon = daemon_pid(NS, "sb")
    assert str(shim["bundle"] / "rootfs") in mounts_under(shim["bundle"], daemon)
    assert mounts_under(bundle, daemon) == []
    shared = pathlib.Path(f"/run/podvm/{NS}/sb/shared")
    assert sorted(os.listdir(shared)) == ["sb"]  # only the sandbox's rootfs is shared
    with pytest.raises(TtrpcError) as err:
        await create(shim, "sb", shim["bundle"], fifos)
    assert err.value.code == Code.ALREADY_EXISTS


async def test_pause_update_pids_stats_and_kill_all(shim) -> None:
    fifos = Fifos(shim["tmp"], "busy")
    script = "sleep 1000 & sleep 1000 & echo started; wait"
    await create(shim, "busy", workload_bundle(shim, "busy", args=["sh", "-c", script],
                                               memory=64 << 20), fifos)
    await call(shim, "Start", api.StartRequest(id="busy"), api.StartResponse)
    assert b"started" in await fifos.read(fifos.out, b"started")
    async with asyncio.timeout(30):
        pids = await call(shim, "Pids", api.PidsRequest(id="busy"), api.PidsResponse)
    assert len(pids.processes) == 3, pids  # sh and its two sleeps
    async with asyncio.timeout(30):
        await call(shim, "Pause", api.PauseRequest(id="busy"))
    state = await call(shim, "State", api.StateRequest(id="busy"))
    assert state.status == 4  # PAUSED
    async with asyncio.timeout(30):
        await call(shim, "Resume", api.ResumeRequest(id="busy"))
    state = await call(shim, "State", api.StateRequest(id="busy"))
    assert state.status == 2  # RUNNING
    update = api.UpdateTaskRequest(id="busy")
    update.resources.type_url = "types.containerd.io/opencontainers/runtime-spec/1/LinuxResources"
    update.resources.value = json.dumps({"memory": {"limit": 96 << 20}}).encode()
    async with asyncio.timeout(30):
        await call(shim, "Update", update)
        stats = await call(shim, "Stats", api.StatsRequest(id="busy"), api.StatsResponse)
    from podvm_core.pb.containerd.cgroups.v2 import metrics_pb2
    assert stats.stats.type_url == "io.containerd.cgroups.v2.Metrics"  # containerd's name
    metrics = metrics_pb2.Metrics.FromString(stats.stats.value)
    assert metrics.memory.usage_limit == 96 << 20
    assert metrics.pids.current == 3
    async with asyncio.timeout(30):
        await call(shim, "Kill", api.KillRequest(id="busy", signal=9, all=True))
        waited = await call(shim, "Wait", api.WaitRequest(id="busy"), api.WaitResponse)
    assert waited.exit_status == 137
    await call(shim, "Delete", api.DeleteRequest(id="busy"), api.DeleteResponse)


RACE_ROUNDS = int(os.environ.get("PODVM_RACE_ROUNDS", "3"))
"""Rounds of the concurrency test in the suite; run it with 50 to qualify a change."""


async def both(shim, method, request, response=api.StateResponse) -> list:
    """The same call twice at once on one connection: the answers, errors as values."""
    return await asyncio.gather(call(shim, method, request, response),
                                call(shim, method, request, response),
                                return_exceptions=True)


def codes(results: list) -> list:
    return sorted(r.code.name if isinstance(r, TtrpcError) else "OK" for r in results)


async def test_concurrent_calls_on_one_process_have_one_winner(shim) -> None:
    """containerd serves nothing one at a time: two Starts, a Kill beside a Delete, two
    Deletes of one process arrive together. Exactly one of each pair acts, the other
    gets the code containerd expects, and State and the events stay consistent. Every
    round reuses the same container ids: one the host or the guest had not forgotten
    would make the next round's Create fail."""
    cid, idle = "race", "race-idle"
    shared = pathlib.Path(f"/run/podvm/{NS}/sb/shared")
    for i in range(RACE_ROUNDS):
        room = shim["tmp"] / f"round-{i}"
        room.mkdir()
        here = {**shim, "tmp": room}
        await create(shim, cid, workload_bundle(here, cid, args=["sleep", "1000"]),
                     Fifos(room, cid))
        started = await both(shim, "Start", api.StartRequest(id=cid), api.StartResponse)
        assert codes(started) == ["FAILED_PRECONDITION", "OK"], started
        assert (await call(shim, "State", api.StateRequest(id=cid))).status == 2  # running
        killed, deleted = await asyncio.gather(
            call(shim, "Kill", api.KillRequest(id=cid, signal=9)),
            call(shim, "Delete", api.DeleteRequest(id=cid), api.DeleteResponse),
            return_exceptions=True)
        assert not isinstance(killed, BaseException), killed
        if isinstance(deleted, TtrpcError):  # still running when Delete looked: refused
            assert deleted.code == Code.FAILED_PRECONDITION, deleted
            waited = await call(shim, "Wait", api.WaitRequest(id=cid), api.WaitResponse)
            assert waited.exit_status == 137
            gone = await both(shim, "Delete", api.DeleteRequest(id=cid), api.DeleteResponse)
            assert codes(gone) == ["NOT_FOUND", "OK"], gone
        else:  # the exit was in before Delete looked: it deleted the killed process
            assert deleted.exit_status == 137, deleted

        # never started: two Deletes and a Kill at once (Delete kills it in the guest)
        await create(shim, idle, workload_bundle(here, idle, args=["sleep", "1000"]),
                     Fifos(room, idle))
        *gone, killed = await asyncio.gather(
            call(shim, "Delete", api.DeleteRequest(id=idle), api.DeleteResponse),
            call(shim, "Delete", api.DeleteRequest(id=idle), api.DeleteResponse),
            call(shim, "Kill", api.KillRequest(id=idle, signal=9)), return_exceptions=True)
        assert codes(gone) == ["NOT_FOUND", "OK"], gone
        assert next(g for g in gone if not isinstance(g, TtrpcError)).exit_status == 137
        assert codes([killed]) in (["OK"], ["NOT_FOUND"]), killed  # before or after

        for name in (cid, idle):
            with pytest.raises(TtrpcError) as err:
                await call(shim, "State", api.StateRequest(id=name))
            assert err.value.code == Code.NOT_FOUND
            async with asyncio.timeout(30):
                while shim["deleted"].count(name) < i + 1:
                    await asyncio.sleep(0.05)
            assert shim["deleted"].count(name) == i + 1
        assert sorted(os.listdir(shared)) == ["sb"]  # no container's files left shared


EXEC_ROUNDS = 15
"""Enough to tell: a leak of an exec's two pipes a round puts the last five rounds 20 or
more files above the first, against a margin of at most 5 (an fd held for a moment)."""
PROBE_CAPS = ["CAP_SYS_PTRACE"]  # to read another process's /proc/<pid>/fd
# A glob, not ls: ls stats each fd, and one the agent closes meanwhile is an error.
PROBE = {"args": ["sh", "-c", "set -- /proc/1/fd/*; echo $#"], "cwd": "/", "env": ["PATH=/bin"],
         "user": {"uid": 0, "gid": 0},
         "capabilities": {k: PROBE_CAPS for k in ("bounding", "effective", "permitted")}}
"""An exec that prints how many files the guest agent (PID 1 of the guest) holds open."""


async def test_exec_probes_leave_nothing_in_the_guest(vm_shim) -> None:
    """kubelet runs an exec probe (ExecSync: Exec, Start, Wait, Delete) every few seconds
    for the life of a container, here always under one id: each Delete makes the guest
    forget the exec, so its id is free again, and the agent holds no more open files
    (an exec's stdio) after the last round than after the first. The container shares
    the guest's pid namespace (hostPID, as it were), so that its execs see the agent."""
    bundle = workload_bundle(vm_shim, "probed", args=["sleep", "1000"])
    config = json.loads((bundle / "config.json").read_text())
    config["linux"]["namespaces"] = [ns for ns in config["linux"]["namespaces"]
                                     if ns["type"] != "pid"]
    (bundle / "config.json").write_text(json.dumps(config))
    await create(vm_shim, "probed", bundle, Fifos(vm_shim["tmp"], "probed"))
    await call(vm_shim, "Start", api.StartRequest(id="probed"), api.StartResponse)
    open_files = []
    for i in range(EXEC_ROUNDS):
        fifos = Fifos(vm_shim["tmp"], f"probe-{i}")
        req = api.ExecProcessRequest(id="probed", exec_id="probe", **fifos.request_fields())
        req.spec.type_url = "types.containerd.io/opencontainers/runtime-spec/1/Process"
        req.spec.value = json.dumps(PROBE).encode()
        async with asyncio.timeout(60):
            await call(vm_shim, "Exec", req)
            await call(vm_shim, "Start", api.StartRequest(id="probed", exec_id="probe"),
                       api.StartResponse)
            out = await fifos.read(fifos.out, b"\n")
            waited = await call(vm_shim, "Wait", api.WaitRequest(id="probed", exec_id="probe"),
                                api.WaitResponse)
            deleted = await call(vm_shim, "Delete", api.DeleteRequest(id="probed",
                                                                   exec_id="probe"),
                                 api.DeleteResponse)
        try:
            err = os.read(fifos.err, 65536)
        except BlockingIOError:
            err = b""
        os.close(fifos.out)
        os.close(fifos.err)
        assert waited.exit_status == deleted.exit_status == 0 and not err, (i, out, err)
        open_files.append(int(out))
    with pytest.raises(TtrpcError) as gone:
        await call(vm_shim, "State", api.StateRequest(id="probed", exec_id="probe"))
    assert gone.value.code == Code.NOT_FOUND
    # Without the forgetting, the two pipes of each finished exec would stay open (+2 a
    # round). The least of the last rounds: an fd the agent holds for a moment (a runc
    # call's pipe) may be counted in any one round.
    assert open_files[0] > 3 and min(open_files[-5:]) <= max(open_files[:5]), open_files
    async with asyncio.timeout(30):
        await call(vm_shim, "Kill", api.KillRequest(id="probed", signal=9))
        await call(vm_shim, "Wait", api.WaitRequest(id="probed"), api.WaitResponse)
    await call(vm_shim, "Delete", api.DeleteRequest(id="probed"), api.DeleteResponse)
