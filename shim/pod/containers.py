"""The pod's containers in its guest: each one added (re-planned, its files shared, created
in the guest) and removed, and every act on their processes the Task API asks for, each a
thin call of the guest agent that raises the pod's typed error (shim/pod/errors.py) when
the VM is not running or is gone. Part of the Pod (shim/pod/pod.py)."""
from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from podvm_core.ttrpc import TtrpcError

from ..host import emptydir
from ..resources.model import from_linux_resources
from ..vm import guestspec
from ..vm.stdio import ProcessIO, Stdio
from .errors import NotRunning, PodError, Refused, StaticRefusal, VMGone
from .hostns import refuse_host_propagation
from .podfiles import with_mounts

if TYPE_CHECKING:
    from podvm_core.pb.agent import agent_pb2 as pb

    from ..config import Config
    from ..host.mounts import Mount
    from ..vm.agent import Agent
    from ..vm.hypervisor import HypervisorError
    from ..vm.machine import Machine

log = logging.getLogger("podvm.pod")


class PodContainers:
    """The Pod's containers and their processes (a part of Pod: its state is the Pod's)."""

    id: str
    config: Config
    machine: Machine | None
    gone: HypervisorError | None
    placed: set[str]
    files: Mapping[str, str]
    hostname: str
    sysctls: dict[str, str]
    # and, from the Pod's other parts: apply() and guest_cpus() (shim/pod/resize.py),
    # stop() (shim/pod/pod.py)

    def _agent(self) -> Agent:
        """The guest agent; the pod's typed error when there is none."""
        if self.gone is not None:
            raise VMGone(self.gone)
        if self.machine is None or self.machine.agent is None:
            raise NotRunning()
        return self.machine.agent

    # --- adding and removing ------------------------------------------------------------

    async def add_container(self, container_id: str, bundle: str, spec: dict,
                            rootfs: list[Mount], stdio: Stdio, *, owns_vm: bool,
                            pod_holder: bool) -> None:
        """Re-plan with the container's resources (the sandbox container's are the
        pod's), share its files, create it in the guest. All or nothing. `owns_vm`: the
        container whose Create booted the VM; `pod_holder`: the container holds the
        pod's namespaces in the guest (a CRI sandbox container)."""
        assert self.machine is not None
        refuse_host_propagation(container_id, spec)
        if not owns_vm:
            resources = from_linux_resources((spec.get("linux") or {}).get("resources") or {})
            try:
                await self.apply(container_id, resources)
            except StaticRefusal:
                await self.apply(container_id, None, quiet=True)  # no container: none kept
                raise
        in_guest = self.machine.has_scratch_disk and not pod_holder
        try:
            guest = guestspec.rewrite(
                with_mounts(spec, self.files), container_id, self.guest_cpus(container_id),
                writable_in_guest=in_guest, local_dirs=emptydir.local_dirs if in_guest and
                not self.config.runtime.disable_guest_empty_dir else None)
        except (OSError, ValueError) as exc:
            if not owns_vm:
                await self.apply(container_id, None, quiet=True)
            raise Refused(f"container {container_id}: {exc}") from None
        for what in guest.dropped:
            log.info("container %s: left out %s", container_id, what)
        try:
            self.machine.share_container(container_id, bundle, rootfs, guest.binds,
                                         guest_reads_only=bool(guest.rootfs_lower) or pod_holder)
            await self._agent().create_container(
                container_id, json.dumps(guest.spec).encode(), stdio, sandbox=owns_vm,
                pod_holder=pod_holder, rootfs_lower=guest.rootfs_lower,
                local_dirs=guest.local_dirs)
        except BaseException as exc:
            await self._undo_add(container_id, owns_vm)
            if isinstance(exc, OSError):
                raise Refused(f"cannot share the files of container {container_id} with "
                              f"its VM: {exc}") from None
            if isinstance(exc, ValueError):
                raise Refused(f"container {container_id}: {exc}") from None
            raise
        self.placed.add(container_id)

    async def _undo_add(self, container_id: str, owns_vm: bool) -> None:
        if self.machine is None:
            return
        try:
            self.machine.unshare_container(container_id)
        except OSError as exc:
            log.error("container %s: cleanup after a failed create: %s", container_id, exc)
        if owns_vm:
            await self.stop()
        else:
            await self.apply(container_id, None, quiet=True)

    async def remove_container(self, container_id: str, owns_vm: bool) -> None:
        """Remove it from the guest and the host; removing the container that booted the
        VM stops the pod."""
        self.placed.discard(container_id)
        machine = self.machine
        if machine is None:
            return
        if machine.agent is not None:
            try:
                await machine.agent.remove(container_id)
            except TtrpcError as exc:
                log.warning("container %s: removal in the guest: %s", container_id,
                            exc.message)
        machine.unshare_container(container_id)
        if owns_vm:
            await self.stop()
        else:
            await self.apply(container_id, None, quiet=True)

    # --- their processes ------------------------------------------------------------------

    def process_io(self, container_id: str, exec_id: str, stdin: str, stdout: str,
                   stderr: str, terminal: bool) -> ProcessIO:
        """The copier of a guest process's stdio to containerd's FIFOs (not started)."""
        return ProcessIO(self._agent(), container_id, exec_id, stdin, stdout, stderr,
                         terminal)

    async def start_container(self, container_id: str) -> None:
        await self._agent().start_container(container_id)

    async def exec_process(self, container_id: str, exec_id: str, process_json: bytes,
                           stdin: str, stdout: str, stderr: str, terminal: bool) -> ProcessIO:
        """Start an exec in the guest; the copier of its stdio (not started)."""
        agent = self._agent()
        await agent.exec_process(container_id, exec_id, process_json,
                                 Stdio.of(stdin, stdout, stderr, terminal))
        return ProcessIO(agent, container_id, exec_id, stdin, stdout, stderr, terminal)

    async def wait(self, container_id: str, exec_id: str) -> pb.WaitProcessResponse:
        """The process's exit, when the guest reports it. A container's init that ended
        (or that the guest lost) is no longer placed: its cpuset need not follow."""
        try:
            result = await self._agent().wait(container_id, exec_id)
        except (TtrpcError, PodError):
            if not exec_id:
                self.placed.discard(container_id)
            raise
        if not exec_id:
            self.placed.discard(container_id)
        return result

    async def signal(self, container_id: str, exec_id: str, signal: int, all_: bool) -> None:
        await self._agent().signal(container_id, exec_id, signal, all_)

    async def resize_pty(self, container_id: str, exec_id: str, width: int,
                         height: int) -> None:
        await self._agent().resize(container_id, exec_id, width, height)

    async def pause_container(self, container_id: str) -> None:
        await self._agent().pause(container_id)

    async def resume_container(self, container_id: str) -> None:
        await self._agent().resume(container_id)

    async def pids(self, container_id: str) -> list[pb.ProcessEntry]:
        return await self._agent().pids(container_id)

    async def stats(self, container_id: str) -> Any:
        """The guest's Metrics, checked by the agent's client (shim/vm/agent.py)."""
        return await self._agent().stats(container_id)

    async def forget_exec(self, container_id: str, exec_id: str) -> None:
        """The guest forgets an exec and closes the stdio it holds."""
        await self._agent().remove_process(container_id, exec_id)

    # --- the pod's own namespaces (Sandbox API) -------------------------------------------

    async def hold_namespaces(self) -> int:
        """A guest process holds the pod's namespaces, with its hostname and sysctls; its
        pid in the guest."""
        return await self._agent().create_pod_namespaces(self.hostname, self.sysctls)

    async def ping(self, timeout: float) -> None:
        await self._agent().ping(timeout=timeout)
