"""One pod's running VM and what the host holds for it: QEMU through the hypervisor
interface (shim/vm/hypervisor.py), the guest agent, the sandbox cgroup, the shared
directory with every container's rootfs and files, the taps. The Pod (shim/pod/pod.py)
owns one Machine per boot and calls it; nothing else reaches into it. The Machine holds
where the VM's threads run in a VMThreads (shim/cpus/vmthreads.py), the plan in force and
its steps in a VMResizer (shim/vm/resize.py), its templates in a Restorer
(shim/vm/template/restore.py), its network in a VMNetwork (shim/vm/vmnetwork.py) and its
scratch disk in a VMScratch (shim/vm/scratchgrow.py), handing each the VM and agent it
acts on.

Everything made on the host is recorded in `sandbox.json` before it is made, so that
`delete` can remove it after a crash from that file alone."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from typing import TYPE_CHECKING, Awaitable, TypeVar

from ..config import Config
from ..cpus.vmthreads import VMThreads
from ..host import diskreserve, mounts, paths
from ..host.cgroup import HostCgroup, layout_for
from ..host.cleanup import remove_tree
from ..host.mounts import Mount
from ..host.podstate import PodState, state_path
from ..host.processes import start_time
from ..host.share import Share
from ..resources import SandboxPlan
from . import guestspec, vmm, vmmlog, workdir
from .agent import Agent
from .hypervisor import VM, HypervisorError, VMSpec
from .resize import VMResizer
from .scratchgrow import VMScratch
from .template import template as templates
from .template.restore import Restorer
from .vmnetwork import VMNetwork

if TYPE_CHECKING:
    from podvm_core.pb.agent import agent_pb2 as pb

    from ..network.ahead import WorkerAhead
    from ..resources import PlanDelta

log = logging.getLogger("podvm.machine")
T = TypeVar("T")


class Machine:
    def __init__(self, namespace: str, sandbox_id: str, config: Config,
                 plan: SandboxPlan, cgroups_path: str = "", netns: str = "",
                 pod_name: tuple[str, str] = ("", ""),
                 network_worker: WorkerAhead | None = None, log_directory: str = "") -> None:
        """`cgroups_path`: the sandbox container's `linux.cgroupsPath` (either syntax);
        the sandbox cgroup goes under its parent, the pod cgroup. `netns`: the pod's
        network namespace, whose interfaces become the VM's ("": the VM has none), and
        `network_worker` the pod's worker that attaches them (the Pod's to close).
        `pod_name`: Kubernetes' name and namespace of the pod, recorded for the node's
        metrics. `log_directory`: kubelet's directory of the pod's logs, where its scratch
        disk is shown (shim/host/podlogdisk.py)."""
        self.id = sandbox_id
        self.config = config
        self.cgroup = HostCgroup(layout_for(cgroups_path, sandbox_id),
                                 shim_in_sandbox=config.runtime.sandbox_cgroup_only,
                                 overhead_cpus=config.runtime.overhead_cpus)
        self.dir = paths.state_dir(namespace, sandbox_id)
        self.share = Share(self.dir)
        """The pod's shared directory: built in `shared/`, exported read-only."""
        self.vm_dir = os.path.join(self.dir, "vm")
        self.vm: VM | None = None
        self.agent: Agent | None = None
        self.state = PodState(sandbox_id=sandbox_id, cgroup=self.cgroup.state(), plan=plan,
                              pod_name=pod_name[0], pod_namespace=pod_name[1])
        """What is persisted in sandbox.json, replaced (and saved) by record()."""
        self.threads = VMThreads(sandbox_id, self.cgroup,
                                 config.runtime.enable_vcpus_pinning, self.record)
        self.resizer = VMResizer(sandbox_id, plan, self.cgroup, self.threads, self.record)
        self.restorer = Restorer(sandbox_id, self.cgroup,
                                 config.runtime.static_sandbox_resource_mgmt, self.record)
        self.network = VMNetwork(sandbox_id, netns, network_worker, self.record)
        self.scratch = VMScratch(sandbox_id, log_directory, self.record)

    @property
    def plan(self) -> SandboxPlan:
        """The plan in force."""
        return self.resizer.plan

    @property
    def vcpu_pins(self) -> list[frozenset[int]]:
        """Where each vCPU may run, by vCPU index (empty: anywhere in the pod cgroup)."""
        return self.threads.vcpu_pins

    @property
    def pid(self) -> int:
        return self.vm.pid if self.vm else 0

    @property
    def has_scratch_disk(self) -> bool:
        """The VM has a scratch disk: its containers' writable layers are there."""
        return self.vm is not None and bool(self.vm.spec.scratch_disk)

    # --- what the Pod asks of its machine ------------------------------------------------

    def ended(self) -> bool:
        """QEMU has exited, or is exiting (the agent's connection closes as it does)."""
        return self.vm is not None and (self.vm.dead() or (
            self.agent is not None and self.agent.lost))

    async def wait(self) -> None:
        """Until QEMU exits."""
        assert self.vm is not None
        await self.vm.wait()

    async def exited(self, grace: float = 0) -> HypervisorError | None:
        """How QEMU ended (shim/vm/hypervisor.py, VM.exited); None while it runs."""
        assert self.vm is not None
        return await self.vm.exited(grace=grace)

    def kill(self) -> None:
        """QEMU killed now, asked nothing (shutdown() removes the rest)."""
        if self.vm is not None:
            self.vm.kill()

    async def unasked_stop(self) -> str:
        """Until QEMU stops the VM without the shim asking: why (VM.unasked_stop)."""
        assert self.vm is not None
        return await self.vm.unasked_stop()

    async def size(self) -> tuple[int, int] | None:
        """vCPUs present and memory in MiB as QEMU reports them now; None before launch."""
        return await self.vm.size() if self.vm is not None else None

    def metrics(self):
        """The sandbox cgroup's metrics (an Any)."""
        return self.cgroup.metrics()

    async def resize(self, delta: PlanDelta) -> None:
        """Carry out one step of the plan (shim/vm/resize.py, VMResizer.resize)."""
        assert self.vm is not None and self.agent is not None
        await self.resizer.resize(self.vm, self.agent, delta)

    def make_template(self) -> None:
        """The template of a shape that had none, made for the next pod (Restorer)."""
        self.restorer.make_template(self.state.pod_namespace)

    def record(self, **changes) -> None:
        """The state with `changes`, saved before the caller acts on it."""
        self.state = dataclasses.replace(self.state, **changes)
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        self.state.save(state_path(self.dir))

    async def boot(self) -> None:
        """Nothing is left behind when it fails."""
        spec = self._spec()
        vm = vmm.create(spec)
        # the disk's claim is the plan in sandbox.json: checked against the others' first
        with diskreserve.reserving(self.config.qemu, self.id, self.plan.disk_mib):
            self.record(qmp_socket=vm.control_socket, netns=self.network.netns)
        vm.check_files()  # a missing kernel is refused before any cgroup is made
        self.vm = vm
        # Made in a thread beside the network's attach: the shim's move into it waits out
        # an RCU grace period (docs/design.md, 6.3). The template's copy, charged there,
        # starts once both the interfaces are named and the cgroup is made.
        made = asyncio.ensure_future(asyncio.to_thread(self.cgroup.create, self.plan))
        try:
            if self.network.netns:
                nics = await self.network.attach(
                    lambda network: self.restorer.copy_ahead(spec, network, made))
                self.vm = vm = vmm.create(dataclasses.replace(spec, nics=nics))
            try:
                await made
                started = time.monotonic()
                template = await self.restorer.launch(vm, self._launching)
            finally:
                for nic in vm.spec.nics:  # QEMU has its own copies now (or none: it failed)
                    nic.close()
            info = await self._connect(template, vm)
            self.record(restored_from=template.key if template is not None else "",
                        boot_seconds=time.monotonic() - started)
            await self.resizer.fit_booted(self.vm, self.agent, info.online_cpus,
                                          info.memory_total_bytes, template is not None)
            if self.has_scratch_disk:
                await self.scratch.grow_and_show(self.vm, self.agent, self.plan.disk_mib)
        except BaseException as exc:
            await asyncio.gather(made, return_exceptions=True)  # made whole, or not at all
            await self._boot_failed(vm, exc)
            raise
        assert self.state.vm is not None
        log.info("sandbox %s: guest up, kernel %s, %d vCPUs, %d MiB", self.id,
                 info.kernel_release, self.state.vm.online_cpus, self.state.vm.memory_total_mib)

    async def time_agent(self) -> None:
        """One round trip to the agent, recorded for the node's metrics: after the boot,
        whose own ping mostly waited for the agent to come up, and off its path."""
        assert self.agent is not None
        started = time.monotonic()
        try:
            await self.agent.ping(timeout=self.config.qemu.boot_timeout)
        except Exception as exc:  # the watches report a guest that is gone
            log.debug("sandbox %s: agent round trip not timed: %s", self.id, exc)
            return
        self.record(agent_rtt_seconds=time.monotonic() - started)

    def _spec(self) -> VMSpec:
        """The VM the plan sizes, its directories made."""
        os.makedirs(self.vm_dir, mode=0o700, exist_ok=True)
        # bounded: a QEMU taken over fills this, not the node's /run
        workdir.bound(self.vm_dir, vmmlog.room_for(self.config.qemu.console_log_max_kib))
        self.share.create()
        # A static VM never grows: no vCPU slots to keep (under TCG each is a thread).
        static = self.config.runtime.static_sandbox_resource_mgmt
        return VMSpec(
            sandbox_id=self.id, workdir=self.vm_dir, shared_dir=self.share.export,
            vcpus=self.plan.vcpus,
            max_vcpus=self.plan.vcpus if static else self.plan.max_vcpus,
            memory_mib=self.plan.memory_mib, max_memory_mib=self.plan.max_memory_mib,
            hypervisor=self.config.qemu, config_source=self.config.source)

    async def _connect(self, template: templates.Template | None, vm: VM) -> pb.PingResponse:
        """The launched VM's agent connected (a restored guest resumed first), then the
        host's and the guest's independent steps at once; what the guest reports."""
        assert self.vm is not None
        timeout = self.config.qemu.boot_timeout
        self.record(qemu_pid=self.vm.pid, qemu_start_time=start_time(self.vm.pid),
                    qemu_jail_id=self.vm.jail_id)
        self.agent = Agent.of_vm(self.vm)
        # The host's side asks nothing of the guest: it goes on while the guest resumes.
        placing = asyncio.ensure_future(self.threads.place(self.vm, self.plan))
        try:
            if template is not None:  # before anything else is asked of the guest
                await self.restorer.resume(template, self.agent, self.vm, vm.spec.nics,
                                           timeout)
        except BaseException:
            placing.cancel()
            await asyncio.gather(placing, return_exceptions=True)
            raise
        info, *_ = await _together(
            self.agent.ping(timeout=timeout), placing,
            *self.network.in_guest(self.agent, self.state.network, timeout))
        return info

    async def _boot_failed(self, vm: VM, exc: BaseException) -> None:
        """Undo the boot; QEMU dying after launch shows up as a broken agent or QMP call:
        then how QEMU ended is raised instead, in its own words (else the caller
        raises `exc`)."""
        gone = await vm.exited(grace=1) if isinstance(exc, Exception) and \
            not isinstance(exc, HypervisorError) else None
        log.error("sandbox %s: boot failed (%s); guest console: %s", self.id,
                  gone or exc, self.console_tail())
        await self.shutdown()
        if gone is not None:
            raise gone from None

    def _launching(self, vm: VM) -> None:
        """The VM being started: the one shutdown() stops (Restorer.launch tells it)."""
        self.vm = vm

    def console_tail(self) -> str:
        return self.vm.console_tail() if self.vm else "(no VM)"

    def share_container(self, container_id: str, bundle: str, rootfs: list[Mount],
                        binds: tuple[guestspec.HostBind, ...], *,
                        guest_reads_only: bool = False) -> None:
        """Mount the container's rootfs on its bundle (as containerd expects) and attach
        it, with its other host files, in the shared directory (shim/host/share.py). All or
        nothing. `guest_reads_only`: the guest never writes the rootfs (its writable
        layer is on the scratch disk, GuestSpec.rootfs_lower; or it is the pod holder's,
        which the guest's agent stands in for): shared read-only."""
        self.record(rootfs={**self.state.rootfs,
                             container_id: os.path.join(bundle, "rootfs")})
        try:
            if rootfs:
                if len(rootfs) != 1:
                    raise ValueError(f"{len(rootfs)} rootfs mounts; podvm takes exactly one")
                mounts.mount(rootfs[0], os.path.join(bundle, "rootfs"))
            # the rootfs this shim mounted is in the pod's mount namespace only
            self.share.add(container_id, os.path.join(bundle, "rootfs"),
                           rootfs_from_host=not rootfs,
                           binds=[(b.source, b.name, b.readonly, b.recursive) for b in binds],
                           rootfs_readonly=guest_reads_only)
        except BaseException:
            self.unshare_container(container_id)
            raise

    def unshare_container(self, container_id: str) -> None:
        """Undo share_container(); a no-op for what is already gone."""
        self.share.remove(container_id)
        bundle_rootfs = self.state.rootfs.get(container_id)
        if bundle_rootfs:
            mounts.unmount(bundle_rootfs)
        self.record(rootfs={c: r for c, r in self.state.rootfs.items() if c != container_id})

    async def shutdown(self) -> None:
        """Stop the VM and remove everything of the sandbox on the host but the state
        directory itself (the daemon removes that last). Idempotent."""
        await self.network.detach_after(self._stop_vm(), self.state.netns, self.state.taps)
        self.cgroup.destroy()
        for container_id in list(self.state.rootfs):
            self.unshare_container(container_id)
        self.share.destroy()
        workdir.unbound(self.vm_dir)
        remove_tree(self.vm_dir)
        self.record(qemu_pid=0, qemu_start_time=None, qemu_jail_id=None)

    async def _stop_vm(self) -> None:
        await self.network.stop_forwarding()  # before the agent, which carries its bytes
        if self.agent is not None:
            agent, self.agent = self.agent, None
            try:
                await asyncio.wait_for(agent.shutdown(), 3)
            except Exception as exc:
                log.debug("agent shutdown: %s", exc)
            await agent.close()
        self.threads.stop()
        await self.restorer.cancel_background()  # its VM stopped, its files gone
        if self.vm is not None:
            await self.vm.stop(timeout=5)
        self.scratch.hide()
        await self.restorer.drop_ahead()  # its copier is in the sandbox cgroup


async def _together(*steps: Awaitable[T]) -> list[T]:
    """The steps' results, run concurrently; the first to fail cancels the others (and
    is waited for) and its exception is raised."""
    tasks = [asyncio.ensure_future(step) for step in steps]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
