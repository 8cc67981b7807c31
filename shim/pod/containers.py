"""The containers placed in a pod's guest: each one's spec as its guest runs it, its files
shared and the container created there, and removed; and every act on their processes the
Task API asks for, each a thin call of the guest agent that raises the pod's typed error
(shim/pod/errors.py) when the VM is not running or is gone. The Pod (shim/pod/pod.py)
holds one Containers and decides the plan around each addition and removal; the VM they
run in is found in the pod's VMSlot (shim/pod/vmslot.py) as each call is made."""
from __future__ import annotations

import asyncio
import json
import logging
import signal as signals
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from podvm_core.ttrpc import TtrpcError

from ..host import emptydir
from ..vm import guestspec
from ..vm.stdio import ProcessIO, Stdio
from .errors import PodError, Refused

if TYPE_CHECKING:
    from podvm_core.pb.agent import agent_pb2 as pb

    from ..config import Config
    from ..host.mounts import Mount
    from ..vm.agent import Agent
    from ..vm.machine import Machine
    from .vmslot import VMSlot

log = logging.getLogger("podvm.pod")


class Containers:
    """The table of the containers in the guest, and the calls that act on them."""

    def __init__(self, pod_id: str, vm: VMSlot, config: Config) -> None:
        self.placed: set[str] = set()
        """Containers in the guest whose cpuset follows the vCPUs' pinning."""
        self._pod_id = pod_id
        self._vm = vm
        self._config = config
        self._removals: set[asyncio.Task] = set()
        """Removals in the guest under way (remove_later)."""

    # --- adding and removing ------------------------------------------------------------

    def guest_spec(self, container_id: str, spec: dict, guest_cpus: list[int] | None, *,
                   pod_holder: bool) -> guestspec.GuestSpec:
        """The container's spec as the guest runs it (its writable layer in the guest
        where the VM has a scratch disk), `guest_cpus` its cpuset there. OSError or
        ValueError for a spec the guest cannot run."""
        assert self._vm.machine is not None
        in_guest = self._vm.machine.has_scratch_disk and not pod_holder
        guest = guestspec.rewrite(
            spec, container_id, guest_cpus, writable_in_guest=in_guest,
            local_dirs=emptydir.local_dirs if in_guest and
            not self._config.runtime.disable_guest_empty_dir else None)
        for what in guest.dropped:
            log.info("container %s: left out %s", container_id, what)
        return guest

    async def create(self, container_id: str, bundle: str, rootfs: list[Mount],
                     guest: guestspec.GuestSpec, stdio: Stdio, *, owns_vm: bool,
                     pod_holder: bool) -> None:
        """Share the container's files with the VM and create it in the guest; its files
        unshared again when that fails. `owns_vm`: the container whose Create booted the
        VM; `pod_holder`: it holds the pod's namespaces in the guest (a CRI sandbox
        container), as the agent stands in for it."""
        try:
            self._vm.machine.share_container(
                container_id, bundle, rootfs, guest.binds,
                guest_reads_only=bool(guest.rootfs_lower) or pod_holder)
            await self._vm.agent().create_container(
                container_id, json.dumps(guest.spec).encode(), stdio, sandbox=owns_vm,
                pod_holder=pod_holder, rootfs_lower=guest.rootfs_lower,
                local_dirs=guest.local_dirs)
        except BaseException as exc:
            self._unshare_after_failure(container_id)
            if isinstance(exc, OSError):
                raise Refused(f"cannot share the files of container {container_id} with "
                              f"its VM: {exc}") from None
            if isinstance(exc, ValueError):
                raise Refused(f"container {container_id}: {exc}") from None
            raise
        self.placed.add(container_id)

    def _unshare_after_failure(self, container_id: str) -> None:
        if self._vm.machine is None:  # stopped meanwhile: its shutdown unshared it
            return
        try:
            self._vm.machine.unshare_container(container_id)
        except OSError as exc:
            log.error("container %s: cleanup after a failed create: %s", container_id, exc)

    async def remove(self, container_id: str) -> None:
        """Remove it from the guest and its files from the host."""
        self.placed.discard(container_id)
        machine = self._vm.machine
        if machine is None:
            return
        await _remove_in_guest(machine, container_id)
        machine.unshare_container(container_id)

    def remove_later(self, container_id: str, then: Callable[[], Awaitable[None]]) -> None:
        """Its files unshared now, its removal in the guest and `then()` after the caller
        has answered: a workload container's exit is known on the host already, and
        containerd's Delete need not wait for a guest among many loaded ones (twenty pods
        removed at once waited about 10 s for each Delete, past containerd's deadline).
        The host's part comes first, so that the `delete` containerd runs next finds
        nothing of it mounted; the guest keeps what it holds of the files until it lets
        go (the mounts are detached lazily). What fails in the guest is logged."""
        self.placed.discard(container_id)
        machine = self._vm.machine

        async def removal() -> None:
            try:
                if machine is not None:
                    await _remove_in_guest(machine, container_id)
                await then()
            except Exception as exc:  # nobody waits for it: said here
                log.warning("container %s: removal: %s", container_id, exc)

        task = asyncio.ensure_future(removal())
        self._removals.add(task)
        task.add_done_callback(self._removals.discard)
        if machine is not None:
            machine.unshare_container(container_id)

    async def removed(self) -> None:
        """Until the removals under way are done: the next container's plan and the
        guest's table do not count the ones containerd has deleted."""
        await asyncio.gather(*self._removals, return_exceptions=True)

    async def drop_removals(self) -> None:
        """The removals under way stopped: the VM stops (before it, so that no re-plan
        follows the pod's stop)."""
        for task in list(self._removals):
            task.cancel()
        await self.removed()

    async def kill_all(self, agent: Agent, grace: float) -> None:
        """SIGKILL to every placed container at once, and their exits reported by
        `agent`, all within `grace` seconds: a guest that answers neither holds the
        stop no longer than that."""
        async def kill(container_id: str) -> None:
            try:
                await agent.signal(container_id, "", signals.SIGKILL, True)
            except TtrpcError as exc:
                log.debug("sandbox %s: kill %s: %s", self._pod_id, container_id,
                          exc.message)
            await agent.wait(container_id, "")

        kills = [asyncio.ensure_future(kill(c)) for c in sorted(self.placed)]
        if not kills:
            return
        _, pending = await asyncio.wait(kills, timeout=grace)
        for task in kills:
            task.cancel()
        await asyncio.gather(*kills, return_exceptions=True)
        if pending:
            log.warning("sandbox %s: %d container(s) still alive after %ss: stopping the VM "
                        "under them", self._pod_id, len(pending), grace)

    # --- their processes ------------------------------------------------------------------

    def process_io(self, container_id: str, exec_id: str, stdin: str, stdout: str,
                   stderr: str, terminal: bool) -> ProcessIO:
        """The copier of a guest process's stdio to containerd's FIFOs (not started)."""
        return ProcessIO(self._vm.agent(), container_id, exec_id, stdin, stdout, stderr,
                         terminal)

    async def start(self, container_id: str) -> None:
        await self._vm.agent().start_container(container_id)

    async def exec_process(self, container_id: str, exec_id: str, process_json: bytes,
                           stdin: str, stdout: str, stderr: str, terminal: bool) -> ProcessIO:
        """Start an exec in the guest; the copier of its stdio (not started)."""
        agent = self._vm.agent()
        await agent.exec_process(container_id, exec_id, process_json,
                                 Stdio.of(stdin, stdout, stderr, terminal))
        return ProcessIO(agent, container_id, exec_id, stdin, stdout, stderr, terminal)

    async def wait(self, container_id: str, exec_id: str) -> pb.WaitProcessResponse:
        """The process's exit, when the guest reports it. A container's init that ended
        (or that the guest lost) is no longer placed: its cpuset need not follow."""
        try:
            result = await self._vm.agent().wait(container_id, exec_id)
        except (TtrpcError, PodError):
            if not exec_id:
                self.placed.discard(container_id)
            raise
        if not exec_id:
            self.placed.discard(container_id)
        return result

    async def signal(self, container_id: str, exec_id: str, signal: int, all_: bool) -> None:
        await self._vm.agent().signal(container_id, exec_id, signal, all_)

    async def resize_pty(self, container_id: str, exec_id: str, width: int,
                         height: int) -> None:
        await self._vm.agent().resize(container_id, exec_id, width, height)

    async def pause(self, container_id: str) -> None:
        await self._vm.agent().pause(container_id)

    async def resume(self, container_id: str) -> None:
        await self._vm.agent().resume(container_id)

    async def pids(self, container_id: str) -> list[pb.ProcessEntry]:
        return await self._vm.agent().pids(container_id)

    async def stats(self, container_id: str) -> Any:
        """The guest's Metrics, checked by the agent's client (shim/vm/agent.py)."""
        return await self._vm.agent().stats(container_id)

    async def forget_exec(self, container_id: str, exec_id: str) -> None:
        """The guest forgets an exec and closes the stdio it holds."""
        await self._vm.agent().remove_process(container_id, exec_id)


async def _remove_in_guest(machine: Machine, container_id: str) -> None:
    """The agent's RemoveContainer, when the VM has an agent; a failure is logged (the
    host's part goes on)."""
    if machine.agent is not None:
        try:
            await machine.agent.remove(container_id)
        except TtrpcError as exc:
            log.warning("container %s: removal in the guest: %s", container_id, exc.message)
