"""A pod VM's network, as its Machine (shim/vm/machine.py) holds it: the interfaces of the
pod's network namespace bridged to taps by the pod's network worker (shim/network/ahead.py)
before QEMU starts, their guest side configured through the agent, CRI PortForward into
the VM (shim/network/portforward.py), and the interfaces given back to the namespace as
the VM goes. Each change is recorded with `record` (the Machine's: sandbox.json) before
anything acts on it, so that `delete` undoes it after a crash (shim/host/cleanup.py)."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Awaitable, Callable

from ..network.ahead import WorkerAhead
from ..network.errors import NetworkError

if TYPE_CHECKING:
    from ..network.model import PodNetwork, TapNic
    from ..network.portforward import PortForwarder
    from .agent import Agent

log = logging.getLogger("podvm.machine")


class VMNetwork:
    def __init__(self, sandbox_id: str, netns: str, worker: WorkerAhead | None,
                 record: Callable[..., None]) -> None:
        """`netns`: the pod's network namespace ("": the VM has no network); `worker`:
        the pod's network worker, which attaches the interfaces (the Pod's to close)."""
        self.id = sandbox_id
        self.netns = netns
        self._worker = worker
        self._record = record
        self._forwarder: PortForwarder | None = None

    async def attach(self, named: Callable[[PodNetwork], None]) -> tuple[TapNic, ...]:
        """The pod's interfaces bridged to taps, recorded; the taps' descriptors are the
        caller's to hand to QEMU and close. `named` is called with the interfaces as
        soon as they are named, before the taps are made (the template's copy starts
        then: shim/vm/template/restore.py, copy_ahead)."""
        assert self._worker is not None
        network, nics = await self._worker.attach(self.netns, named)
        self._record(network=network, taps=tuple(n.tap for n in nics))
        for itf in network.interfaces:
            log.info("sandbox %s: %s (%s, MTU %d, %s) bridged into the VM", self.id,
                     itf.name, itf.mac, itf.mtu, ", ".join(map(str, itf.addresses)) or
                     "no address")
        return nics

    def in_guest(self, agent: Agent, network: PodNetwork | None,
                 timeout: float) -> list[Awaitable[None]]:
        """The guest's side, to run beside the boot's first ping: the interfaces
        configured (the agent takes them before it has answered the ping: one round trip
        less) and port forwarding started. `timeout`: the boot's, as for the ping."""
        steps: list[Awaitable[None]] = []
        if network is not None and network.interfaces:
            steps.append(self._configure(agent, network, timeout))
        if self.netns:
            steps.append(self._forward_ports(agent))
        return steps

    async def stop_forwarding(self) -> None:
        """Port forwarding stopped (before the agent, which carries its bytes, closes);
        a no-op when there is none."""
        if self._forwarder is not None:
            forwarder, self._forwarder = self._forwarder, None
            await forwarder.stop()

    async def detach_after(self, stop: Awaitable[None], netns: str,
                           taps: tuple[str, ...]) -> None:
        """`stop` (the VM's) awaited while the worker that detaches the interfaces starts
        (forked loaded by the fork server's worker parent, or else its imports overlap
        the VM's stop), then `netns`'s interfaces given back from `taps` and that
        recorded. `netns` "" (none, or detached already): `stop` alone. A failure to
        detach is logged: the rest of the teardown still goes, and `delete` tries again."""
        if not netns:
            await stop
            return
        worker = self._worker or WorkerAhead()
        started = asyncio.ensure_future(worker.start())
        try:
            await stop
        finally:
            try:
                await started
                await worker.detach(netns, taps)
                # Detached: the daemon's last cleanup (shim/host/cleanup.py) starts no
                # worker to do it again. It did, on every pod's way out, and the `delete`
                # containerd runs as the daemon goes killed the daemon under it: the
                # orphan kept using the install tree while the last collector of an
                # uninstalled tree looked.
                self._record(netns="", taps=())
            except (NetworkError, OSError) as exc:
                log.error("sandbox %s: detaching the network: %s", self.id, exc)

    async def _configure(self, agent: Agent, network: PodNetwork, timeout: float) -> None:
        started = time.monotonic()
        await agent.configure_network(network, timeout)
        log.info("sandbox %s: guest network configured in %.2fs", self.id,
                 time.monotonic() - started)

    async def _forward_ports(self, agent: Agent) -> None:
        """CRI PortForward into the VM. A pod whose namespace refuses it still runs: only
        `kubectl port-forward` to it fails, and the log says why."""
        from ..network.portforward import PortForwarder  # only for a pod with a network

        forwarder = PortForwarder(self.id, self.netns, agent)
        try:
            await forwarder.start()
        except NetworkError as exc:
            log.error("sandbox %s: no port forwarding: %s", self.id, exc)
            return
        self._forwarder = forwarder
