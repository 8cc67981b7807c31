"""How a pod's VM starts from its shape's template (a part of Machine, shim/vm/machine.py):
the template found, its memory's copy started as soon as the pod's interfaces are known
(the copy is a restore's longest step: it runs while the taps are made and QEMU starts),
the VM restored and made the pod's by the agent's Resume; a VM that found no template
boots, and its shape's template is made in the background for the next pod."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import TYPE_CHECKING

from ..network.model import PlaceholderNic, PodNetwork
from . import template as templates, templatemaker, vmm
from .hypervisor import RestoreFailed, VMSpec, template_mac
from .stateload import MemoryCopy

if TYPE_CHECKING:
    from ..config import Config
    from ..host.cgroup import HostCgroup
    from .agent import Agent
    from .hypervisor import VM

log = logging.getLogger("podvm.machine")


class MachineRestore:
    """The Machine's templates (a part of Machine: its state is the Machine's)."""

    id: str
    config: Config
    cgroup: HostCgroup
    vm: VM | None
    agent: Agent | None
    _untemplated: VMSpec | None
    _template_maker: asyncio.Task | None
    _ahead: tuple[str, MemoryCopy] | None
    # and record() (shim/vm/machine.py)

    def _shape(self, spec: VMSpec) -> VMSpec | None:
        """The shape whose template `spec` would restore; None: it restores none."""
        # A static VM is the confidential one: it shares no memory with other pods.
        if self.config.runtime.static_sandbox_resource_mgmt:
            return None
        return templatemaker.class_of(spec)

    def copy_ahead(self, spec: VMSpec, network: PodNetwork) -> None:
        """The memory of the template that `spec` with `network`'s interfaces will
        restore, copied from now on (into the pod's cgroup, made already); nothing where
        it has none. What goes wrong is left to the launch, which finds it again."""
        nics = tuple(PlaceholderNic(index, itf.mtu)
                     for index, itf in enumerate(network.interfaces))
        shape = self._shape(dataclasses.replace(spec, nics=nics))
        if shape is None:
            return
        template = templates.of(shape)
        try:
            if template.exists():
                self._ahead = template.key, MemoryCopy(
                    template.saved(), shape.memory_mib << 20, self.cgroup.preexec())
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

    async def _launch(self, vm: VM) -> templates.Template | None:
        """Start `vm`: restored from its shape's template when there is one, else booted
        at once (its shape's template is then made in the background: make_template);
        the template restored, None when booted. self.vm is the VM started (or being
        started)."""
        preexec = self.cgroup.preexec()
        shape = self._shape(vm.spec)
        if shape is not None:
            template = templates.of(shape)
            memory = await self._take_ahead(template.key)
            if template.exists():
                self.vm = restored = vmm.create(dataclasses.replace(shape, template=True))
                try:
                    await restored.launch(
                        preexec=preexec, memory=memory,
                        restore_from=memory.saved if memory else template.saved())
                    log.info("sandbox %s: VM restored from template %s", self.id,
                             template.key)
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
        self.vm = vm
        await vm.launch(preexec=preexec)
        return None

    def make_template(self) -> None:
        """After a boot that found no template of its shape: that template made in the
        background (in its own cgroup, shim/vm/templatemaker.py), for the next pod;
        cancelled by shutdown() if the pod goes first."""
        if self._untemplated is not None and self._template_maker is None:
            self._template_maker = asyncio.create_task(templatemaker.make_in_background(
                self._untemplated, self.id, lambda cg: self.record(template_cgroup=cg)))

    async def _resume(self, template: templates.Template, vm: VM, timeout: float) -> None:
        """The restored guest made this pod's (its agent's Resume); the template discarded
        when its guest cannot be."""
        assert self.agent is not None and self.vm is not None
        started = time.monotonic()
        try:
            await self.agent.resume_restored(
                {template_mac(n.index): n.mac for n in vm.spec.nics}, timeout=timeout)
        except Exception as exc:
            if not self.vm.dead():  # a QEMU killed meanwhile says nothing of it
                template.discard(f"the guest restored from it did not resume: {exc}")
            raise
        log.info("sandbox %s: guest resumed in %.2fs", self.id, time.monotonic() - started)
