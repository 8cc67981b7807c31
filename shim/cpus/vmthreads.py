"""Where one pod VM's threads run: each in the sandbox cgroup its role says (vCPUs in
vcpus/, the rest and the VM's helpers in vmm/: docs/design.md, "Sandbox cgroup layout"),
the vCPUs on the pod's CPUs (shim/cpus/pinning.py; docs/design.md, "CPUs: pinning and
exclusive CPUs"), and kept there while the VM runs. The Machine (shim/vm/machine.py)
holds one and hands it to its VMResizer (shim/vm/resize.py), which has it follow each
step of the plan."""
from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Callable, Mapping, Protocol

import cgroups
from cgroups.layout import VCPU_ROLE
from cgroups.procs import thread_ids
from podvm_core.cpulist import format_cpu_list, parse_cpu_list

from ..resources import SandboxPlan
from . import pinning

if TYPE_CHECKING:
    from ..host.cgroup import HostCgroup

log = logging.getLogger("podvm.cpus")

WATCH_INTERVAL = 1.0


class VM(Protocol):
    """What placing and pinning need of a VM (shim/vm/hypervisor.py's VM is one): its
    process, its helpers' and its threads by role (ThreadRole, a str: "vcpu" is cgroups'
    VCPU_ROLE)."""

    @property
    def pid(self) -> int: ...

    @property
    def helper_pids(self) -> list[int]: ...

    async def threads(self) -> Mapping[str, list[int]]: ...


class VMThreads:
    """The VM's threads placed and pinned; where each vCPU may run, each change recorded
    with `record` (the Machine's: sandbox.json)."""

    def __init__(self, sandbox_id: str, cgroup: HostCgroup, pin_vcpus: bool,
                 record: Callable[..., None]) -> None:
        """`cgroup`: the sandbox cgroup, made; `pin_vcpus`: enable_vcpus_pinning."""
        self.id = sandbox_id
        self.vcpu_pins: list[frozenset[int]] = []
        """Where each vCPU may run, by vCPU index (empty: anywhere in the pod cgroup)."""
        self._cgroup = cgroup
        self._pin_vcpus = pin_vcpus
        self._record = record
        self._known_tids: frozenset[int] = frozenset()
        self._watch: asyncio.Task | None = None

    async def place(self, vm: VM, plan: SandboxPlan) -> None:
        """Every thread of the VM and its helpers (virtiofsd) into its cgroup by role, the
        vCPUs pinned as `plan` says, and every thread watched from now on."""
        sandbox = self._cgroup.sandbox
        assert sandbox is not None
        roles = await vm.threads()
        for pid in (vm.pid, *vm.helper_pids):
            sandbox.adopt_process(pid)
        placed = sandbox.place_threads(roles)
        self._known_tids = frozenset(t for tids in roles.values() for t in tids)
        log.info("sandbox %s: QEMU threads placed: %s", self.id,
                 ", ".join(f"{role} {tids}" for role, tids in placed.items()))
        await self.pin(vm, plan)
        self._watch = asyncio.create_task(self._keep(vm))

    async def place_new(self, vm: VM, ask_vm: bool = True) -> None:
        """Sort threads that are not where their role says (after a hot-plug, say). The
        VM is asked which are vCPUs when `ask_vm`, else only when threads came or went
        since it was last asked (otherwise this reads /proc alone); ProcessGone when the
        VM's process has exited."""
        sandbox = self._cgroup.sandbox
        assert sandbox is not None
        if not ask_vm:
            ask_vm = frozenset(thread_ids(vm.pid)) != self._known_tids
        vcpus: list[int] = []
        if ask_vm:
            try:
                roles = await vm.threads()
            except Exception as exc:  # QEMU going away
                log.debug("thread scan of sandbox %s: %s", self.id, exc)
                return
            vcpus = roles.get(VCPU_ROLE, [])
            self._known_tids = frozenset(t for tids in roles.values() for t in tids)
        moved = sandbox.place_new_threads(vm.pid, vcpus)
        for pid in vm.helper_pids:
            try:
                moved.update(sandbox.place_new_threads(pid))
            except cgroups.ProcessGone:
                pass
        if moved:
            log.info("sandbox %s: QEMU threads placed: %s", self.id,
                     ", ".join(f"{role} {tids}" for role, tids in moved.items()))

    async def pin(self, vm: VM, plan: SandboxPlan) -> None:
        """vCPU threads on the plan's cpuset (no cpuset: the CPUs the vcpus/ cgroup
        allows): 1:1 when enable_vcpus_pinning and the plan's vCPUs and the CPUs are as
        many, else floating over the set. Done after every change: an affinity set here
        outlives a later, wider cpuset (Linux keeps the user's mask), so it is always
        rewritten."""
        cpuset = parse_cpu_list(plan.cpuset) if plan.cpuset else self._cgroup.vcpu_cpus()
        vcpus = (await vm.threads()).get(VCPU_ROLE, [])
        pins = pinning.pin_map(vcpus, plan.vcpus, cpuset, self._pin_vcpus)
        pinning.apply(pins, owner=vm.pid)
        self.vcpu_pins = [pins.get(t, frozenset()) for t in vcpus[:plan.vcpus]]
        self._record(vcpu_pins=tuple(format_cpu_list(p) for p in self.vcpu_pins))
        if pins:
            log.info("sandbox %s: vCPUs on host CPUs %s", self.id,
                     ", ".join(f"{i}->{format_cpu_list(p)}"
                               for i, p in enumerate(self.vcpu_pins)))

    def stop(self) -> None:
        """The watch ends (the VM is stopping); idempotent."""
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None

    async def _keep(self, vm: VM) -> None:
        """Threads the VM makes later (I/O workers, hot-plugged vCPUs) start in their
        creator's cgroup, and anyone may move a thread: every second, each thread not
        where its role says is put back, until the VM's process is gone."""
        while True:
            await asyncio.sleep(WATCH_INTERVAL)
            try:
                await self.place_new(vm, ask_vm=False)
            except cgroups.ProcessGone:
                return
            except cgroups.CgroupError as exc:
                log.warning("sandbox %s: thread placement: %s", self.id, exc)
