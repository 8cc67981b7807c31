"""How a pod's VM starts from its shape's template: the template found, its memory's copy
started as soon as the pod's interfaces are known (the copy is a restore's longest step:
it runs while the taps are made and QEMU starts), the VM restored and made the pod's by
the agent's Resume; a VM that found no template boots, and its shape's template is made
in the background for the next pod; a template read from disk (not all of it in the
host's page cache: shim/vm/template/cache.py) is warmed in the background once the pod
is resumed. The Machine (shim/vm/machine.py) holds one Restorer and hands it the VMs it
launches."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Awaitable, Callable

from ...network.model import PlaceholderNic, PodNetwork
from .. import vmm
from ..hypervisor import RestoreFailed, VMSpec, template_mac
from ..stateload import MemoryCopy
from . import cache, maker, template as templates

if TYPE_CHECKING:
    from ...config import HypervisorConfig
    from ...host.cgroup import HostCgroup
    from ...network.model import TapNic
    from ..agent import Agent
    from ..hypervisor import VM, SavedVM

log = logging.getLogger("podvm.machine")


class Restorer:
    """One pod's templates: the copy of one's memory started ahead, the restore, and the
    template made for a shape that had none, its cgroup recorded with `record` (the
    Machine's: sandbox.json)."""

    def __init__(self, sandbox_id: str, cgroup: HostCgroup, static: bool,
                 record: Callable[..., None]) -> None:
        """`cgroup`: the sandbox cgroup, where QEMU and the copy run. `static`:
        static_sandbox_resource_mgmt, the confidential VM, which restores no template."""
        self.id = sandbox_id
        self._cgroup = cgroup
        self._static = static
        self._record = record
        self._untemplated: VMSpec | None = None
        """The shape of a VM that booted for want of a template (make_template)."""
        self._template_maker: asyncio.Task | None = None
        self._cold: tuple[HypervisorConfig, SavedVM] | None = None
        """The configuration and saved VM of the template restored not wholly from the
        page cache, to warm once its guest resumed."""
        self._warming: asyncio.Task | None = None
        self._ahead: tuple[str, MemoryCopy] | None = None
        """The template's key and its memory's copy, started before the VM (copy_ahead)."""

    def _shape(self, spec: VMSpec) -> VMSpec | None:
        """The shape whose template `spec` would restore; None: it restores none."""
        # A static VM is the confidential one: it shares no memory with other pods.
        if self._static:
            return None
        return maker.class_of(spec)

    def copy_ahead(self, spec: VMSpec, network: PodNetwork, made: Awaitable[object]
                   ) -> None:
        """The memory of the template that `spec` with `network`'s interfaces will
        restore, copied from now on, or from when `made` (the pod's sandbox cgroup being
        made: the copy is charged there) is done; nothing where it has none. What goes
        wrong is left to the launch, which finds it again."""
        nics = tuple(PlaceholderNic(index, itf.mtu)
                     for index, itf in enumerate(network.interfaces))
        shape = self._shape(dataclasses.replace(spec, nics=nics))
        if shape is None:
            return
        template = templates.of(shape)
        try:
            if template.exists():
                self._ahead = template.key, MemoryCopy(
                    template.saved(), shape.memory_mib << 20, self._cgroup.preexec, made)
                log.info("sandbox %s: template %s's memory copied ahead, as the network "
                         "is attached", self.id, template.key)
        except (OSError, RestoreFailed) as exc:
            log.debug("sandbox %s: template %s not copied ahead: %s", self.id,
                      template.key, exc)

    async def _take_ahead(self, key: str) -> MemoryCopy | None:
        """The copy started ahead if it is of template `key`; one of another is stopped."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return None
        if ahead[0] != key:
            await ahead[1].close()
            return None
        return ahead[1]

    async def drop_ahead(self) -> None:
        """A copy started ahead that no VM took, stopped. Idempotent."""
        await self._take_ahead("")

    async def launch(self, vm: VM, launching: Callable[[VM], None]) -> templates.Template | None:
        """Start `vm`: restored from its shape's template when there is one, else booted
        at once (its shape's template is then made in the background: make_template);
        the template restored, None when booted. `launching`: told of each VM before it
        starts, the one to stop if the boot fails."""
        preexec = self._cgroup.preexec()
        shape = self._shape(vm.spec)
        if shape is not None:
            template = templates.of(shape)
            memory = await self._take_ahead(template.key)
            if template.exists():
                restored = vmm.create(dataclasses.replace(shape, template=True))
                launching(restored)
                try:
                    saved = memory.saved if memory else template.saved()
                    await restored.launch(preexec=preexec, memory=memory, restore_from=saved)
                    # "" where the VM copied it itself: cache.warm looks then
                    chunks = memory.chunks if memory is not None else ""
                    log.info("sandbox %s: VM restored from template %s%s", self.id,
                             template.key, f", {chunks.count('1')} of its "
                             f"{len(chunks) - chunks.count('-')} chunks of memory read "
                             f"from the page cache, copied in {memory.seconds:.3f}s"
                             if chunks and memory is not None else "")
                    if not chunks or "0" in chunks:
                        self._cold = shape.hypervisor, saved
                    template.record_use()
                    return template
                except RestoreFailed as exc:
                    template.discard(str(exc))
                finally:
                    if memory is not None:  # the VM's once it took it: then nothing here
                        await memory.close()
            elif memory is not None:  # the template was removed meanwhile
                await memory.close()
            self._untemplated = shape
        launching(vm)
        await vm.launch(preexec=preexec)
        return None

    def make_template(self, namespace: str) -> None:
        """After a boot that found no template of its shape: that template made in the
        background (in its own cgroup, shim/vm/template/maker.py), for the next pod,
        counted against the bounds on new shapes of the pod's Kubernetes `namespace`;
        cancelled by cancel_background() if the pod goes first."""
        if self._untemplated is not None and self._template_maker is None:
            self._template_maker = asyncio.create_task(maker.make_in_background(
                self._untemplated, self.id, lambda cg: self._record(template_cgroup=cg),
                namespace))

    async def cancel_background(self) -> None:
        """The template being made or warmed in the background stopped (the pod goes
        first)."""
        for task in (self._template_maker, self._warming):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    async def resume(self, template: templates.Template, agent: Agent, restored: VM,
                     nics: tuple[TapNic | PlaceholderNic, ...], timeout: float) -> None:
        """The guest `restored` from `template` made this pod's, with `nics` (its agent's
        Resume); the template discarded when its guest cannot be."""
        started = time.monotonic()
        try:
            await agent.resume_restored(
                {template_mac(n.index): n.mac for n in nics}, timeout=timeout)
        except Exception as exc:
            if not restored.dead():  # a QEMU killed meanwhile says nothing of it
                template.discard(f"the guest restored from it did not resume: {exc}")
            raise
        log.info("sandbox %s: guest resumed in %.2fs", self.id, time.monotonic() - started)
        if self._cold is not None and self._warming is None:  # off this pod's path now
            q, saved = self._cold
            self._warming = asyncio.create_task(cache.warm(q, saved.memory,
                                                           saved.memory_digests))
