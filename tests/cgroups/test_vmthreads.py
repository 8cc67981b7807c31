"""Where the shim puts a VM's threads (shim/cpus/vmthreads.py), on this machine's real
cgroups, with a process standing in for QEMU: every thread sorted by role and the vCPU
pinned at once, a thread moved later put back by the watch, and the watch ended when the
process is gone."""
from __future__ import annotations

import asyncio
import os
from types import SimpleNamespace

from cgroups import SandboxCgroup
from shim.cpus.vmthreads import VMThreads
from tests.cgroups.conftest import expected_for, threads_of, where


class StandIn:
    """The VM as VMThreads sees it: the helper process, its first worker the one vCPU."""

    def __init__(self, helper) -> None:
        self.pid, self.helper_pids = helper.pid, []
        self.vcpu = helper.workers[0]

    async def threads(self) -> dict[str, list[int]]:
        rest = [t for t in threads_of(self.pid) if t not in (self.vcpu, self.pid)]
        return {"vcpu": [self.vcpu], "main": [self.pid], "other": rest}


def misplaced(manager, layout, vm: StandIn) -> list[int]:
    return [t for t in threads_of(vm.pid) if where(manager, vm.pid, t) != expected_for(
        manager, layout, "vcpus" if t == vm.vcpu else "vmm")]


async def test_placed_pinned_kept_and_let_go(manager, layout, start_helper) -> None:
    assert len(os.sched_getaffinity(0)) >= 2, "pinning to one CPU must be a change"
    sandbox = SandboxCgroup.create(layout, manager=manager)
    helper = start_helper(sandbox, threads=3)
    vm = StandIn(helper)
    recorded: dict = {}
    threads = VMThreads("sb", SimpleNamespace(sandbox=sandbox),  # type: ignore[arg-type]
                        pin_vcpus=True, record=recorded.update)
    cpu = min(os.sched_getaffinity(0))
    plan = SimpleNamespace(cpuset=str(cpu), vcpus=1)
    try:
        await threads.place(vm, plan)  # type: ignore[arg-type]
        assert misplaced(manager, layout, vm) == []
        assert os.sched_getaffinity(vm.vcpu) == {cpu}
        assert threads.vcpu_pins == [frozenset({cpu})]
        assert recorded == {"vcpu_pins": (str(cpu),)}

        other = next(t for t in threads_of(vm.pid) if t not in (vm.vcpu, vm.pid))
        assert manager.move_thread(layout, "vmm", vm.vcpu)
        assert manager.move_thread(layout, "vcpus", other)
        assert misplaced(manager, layout, vm) == [t for t in threads_of(vm.pid)
                                                   if t in (vm.vcpu, other)]
        async with asyncio.timeout(10):  # the watch looks every second
            while misplaced(manager, layout, vm):
                await asyncio.sleep(0.2)

        watch = threads._watch
        assert watch is not None and not watch.done()
        helper.proc.kill()
        helper.proc.wait()
        async with asyncio.timeout(10):
            await watch  # returns once the process is gone, nothing raised
    finally:
        threads.stop()
