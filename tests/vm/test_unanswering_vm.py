"""A VM that stops answering never holds its pod's stop (docs/design.md, "A VM that stops
answering"): a kill the guest does not answer within its deadline, or QEMU stopping the
VM unasked, ends the VM; every container is reported exited 137 (as runc reports a
SIGKILL'd process) and the pod is then deleted as containerd deletes it, with nothing
left. What the shim does here is the host's: on the FakeVM (testbed/fakevm.py), whose
process is stopped with SIGSTOP (a hung VMM: neither its agent nor its QMP answers), or
paused by a QMP client of the test's own, as an operator would; and QEMU's own STOP
event and run state, as the shim reads them, on a real QEMU (one boot)."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pathlib
import signal
import time

import psutil
import pytest
from qemu.qmp import QMPClient

from podvm_core.pb.containerd.task.v2 import shim_pb2 as api
from podvm_core.ttrpc import Code, TtrpcError

from shim.host import paths
from shim.host.podstate import state_path
from shim.pod.containers import Containers
from shim.pod.vmslot import VMSlot
from shim.vm.agent import RUNC
from shim.vm.qemu.driver import QemuVM
from testbed.shimproc import daemon_pid, wait_gone
from testbed.taskshim import (NS, Fifos, busybox_rootfs, call, create, shim_daemon,
                              workload_bundle)

from .test_qemu import spec


@pytest.fixture(scope="module")
def rootfs(tmp_path_factory) -> pathlib.Path:
    return busybox_rootfs(tmp_path_factory.mktemp("busybox-rootfs"))


async def pod_with_app(ctx: dict) -> int:
    """The sandbox container and `app` (sleeping) running; the VMM's pid."""
    created = await create(ctx, "sb", ctx["bundle"], Fifos(ctx["tmp"], "sb"))
    await call(ctx, "Start", api.StartRequest(id="sb"), api.StartResponse)
    await create(ctx, "app", workload_bundle(ctx, "app", args=["sleep", "1000"]),
                 Fifos(ctx["tmp"], "app"))
    await call(ctx, "Start", api.StartRequest(id="app"), api.StartResponse)
    return created.pid


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


async def both_exited_137_and_deleted(ctx: dict, vmm: int) -> None:
    """What containerd then does: waits, deletes the container, kills (already
    finished) and deletes the sandbox container, shuts the shim down; nothing is left."""
    for cid in ("app", "sb"):
        async with asyncio.timeout(10):
            waited = await call(ctx, "Wait", api.WaitRequest(id=cid), api.WaitResponse)
        assert waited.exit_status == 137, cid
    # SIGKILLed as the exits are told: dead within moments, even on a busy machine
    deadline = time.monotonic() + 10
    while not gone(vmm) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert gone(vmm)
    deleted = await call(ctx, "Delete", api.DeleteRequest(id="app"), api.DeleteResponse)
    assert deleted.exit_status == 137
    with pytest.raises(TtrpcError) as finished:
        await call(ctx, "Kill", api.KillRequest(id="sb", signal=9, all=True))
    assert finished.value.code == Code.NOT_FOUND
    async with asyncio.timeout(30):
        await call(ctx, "Delete", api.DeleteRequest(id="sb"), api.DeleteResponse)
    pid = daemon_pid(NS, "sb")
    try:
        await call(ctx, "Shutdown", api.ShutdownRequest(id="sb"))
    except Exception:
        pass  # containerd takes a closed connection during Shutdown as success
    await wait_gone(pid, timeout=30)
    assert not os.path.exists(paths.state_dir(NS, "sb"))


async def test_a_kill_the_guest_does_not_answer_kills_its_vm(tmp_path, rootfs) -> None:
    async with shim_daemon(tmp_path, rootfs, vmm="fake") as ctx:
        vmm = await pod_with_app(ctx)
        os.kill(vmm, signal.SIGSTOP)  # hung: its agent answers nothing from now on
        started = time.monotonic()
        await call(ctx, "Kill", api.KillRequest(id="app", signal=9))  # answered: done
        took = time.monotonic() - started
        assert RUNC <= took < RUNC + 15, took
        await both_exited_137_and_deleted(ctx, vmm)


async def test_a_container_s_delete_does_not_wait_on_its_guest(tmp_path, rootfs) -> None:
    """Twenty loaded guests answered each Delete in about 10 s, past containerd's deadline:
    a workload container's exit is known on the host, and its Delete answers with it, its
    files unshared, while the guest (here: its VMM stopped) has yet to remove it. The
    removal finishes once the guest answers, before the next container's Create is
    planned; the pod then goes as ever, with nothing left."""
    async with shim_daemon(tmp_path, rootfs, vmm="fake") as ctx:
        vmm = await pod_with_app(ctx)
        await call(ctx, "Kill", api.KillRequest(id="app", signal=9))
        async with asyncio.timeout(10):
            waited = await call(ctx, "Wait", api.WaitRequest(id="app"), api.WaitResponse)
        assert waited.exit_status == 137
        shared = f"/proc/{daemon_pid(NS, 'sb')}/root{paths.state_dir(NS, 'sb')}/shared/app"
        assert os.path.isdir(shared)
        os.kill(vmm, signal.SIGSTOP)  # its agent answers nothing until SIGCONT
        try:
            started = time.monotonic()
            deleted = await call(ctx, "Delete", api.DeleteRequest(id="app"),
                                 api.DeleteResponse)
            assert deleted.exit_status == 137 and time.monotonic() - started < 5
            assert not os.path.exists(shared)  # the host's part is done before it answers
            # the next container waits for the removal: its plan must not count `app`
            again = asyncio.ensure_future(create(
                ctx, "app2", workload_bundle(ctx, "app2", args=["sleep", "1000"]),
                Fifos(ctx["tmp"], "app2")))
            await asyncio.sleep(0.5)
            assert not again.done()
        finally:
            os.kill(vmm, signal.SIGCONT)
        async with asyncio.timeout(30):
            await again
        await call(ctx, "Delete", api.DeleteRequest(id="app2"), api.DeleteResponse)
        await call(ctx, "Kill", api.KillRequest(id="sb", signal=9))
        async with asyncio.timeout(30):
            await call(ctx, "Wait", api.WaitRequest(id="sb"), api.WaitResponse)
            await call(ctx, "Delete", api.DeleteRequest(id="sb"), api.DeleteResponse)
        pid = daemon_pid(NS, "sb")
        with contextlib.suppress(Exception):  # a closed connection is success
            await call(ctx, "Shutdown", api.ShutdownRequest(id="sb"))
        await wait_gone(pid, timeout=30)
        assert not os.path.exists(paths.state_dir(NS, "sb"))


async def test_qemu_stopping_the_vm_unasked_ends_it(tmp_path, rootfs) -> None:
    async with shim_daemon(tmp_path, rootfs, vmm="fake") as ctx:
        vmm = await pod_with_app(ctx)
        with open(state_path(paths.state_dir(NS, "sb"))) as f:
            control = json.load(f)["qmp_socket"]
        operator = QMPClient("operator")  # the socket is in the pod's mount namespace
        await operator.connect(f"/proc/{vmm}/root{control}")
        try:
            await operator.execute("stop")
        finally:  # the shim may kill the VM under the operator before it hangs up
            with contextlib.suppress(EOFError, ConnectionError):
                await operator.disconnect()
        async with asyncio.timeout(10):  # the shim heard STOP: no kill needed
            waited = await call(ctx, "Wait", api.WaitRequest(id="app"), api.WaitResponse)
        assert waited.exit_status == 137
        await both_exited_137_and_deleted(ctx, vmm)


async def test_a_real_qemu_stopping_its_vm_is_heard_with_its_run_state(tmp_path) -> None:
    vm = QemuVM(spec(tmp_path))
    await vm.launch()
    try:
        heard = asyncio.ensure_future(vm.unasked_stop())
        await asyncio.sleep(1)
        assert not heard.done()  # it runs: nothing to hear
        await vm._execute("stop")  # on the shim's own monitor, but no save of its own
        assert await asyncio.wait_for(heard, 30) == "paused"
        vm.kill()  # asked nothing: a stopped VMM is killed as it is
        assert await vm.exited(grace=10) is not None
    finally:
        await vm.stop()


class SilentAgent:
    """A guest agent that answers nothing (its VM paused or hung)."""

    def __init__(self) -> None:
        self.signalled: list[str] = []

    async def signal(self, container_id: str, exec_id: str, signal: int, all_: bool) -> None:
        self.signalled.append(container_id)
        await asyncio.Event().wait()

    async def wait(self, container_id: str, exec_id: str) -> None:
        await asyncio.Event().wait()


async def test_the_sandbox_api_s_kill_of_every_container_is_bounded_by_its_grace() -> None:
    """StopSandbox's kill (shim/pod/containers.py kill_all) of a silent guest's containers:
    all signalled at once, and over within the grace, not a signal's deadline each."""
    containers = Containers("pod", VMSlot(), None)  # type: ignore[arg-type]
    containers.placed.update({"a", "b", "c"})
    agent = SilentAgent()
    started = time.monotonic()
    await asyncio.wait_for(containers.kill_all(agent, grace=1), 10)  # type: ignore[arg-type]
    assert time.monotonic() - started < 3
    assert sorted(agent.signalled) == ["a", "b", "c"]
