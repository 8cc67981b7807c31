"""Templates made off every pod's path: no pod waits for one. A pod whose shape has a
template restores it (shim/vm/machine.py); one whose shape has none boots at once, as
without templates, and its shim then makes the template in the background, for the
next pod of that shape. `podvmctl templates warm` makes the shapes a node will see
before any pod comes (the installer and `make demo` run it).

A template is made in a cgroup of its own (`template_cgroup`, beside the pods' cgroups,
so the node's reserved resources pay for it, never a pod), with low CPU shares (pods go
first) and a memory limit of the template's VM plus its QEMU. One template is made at a
time on a node (the `making` lock in the store): a flood of pods of new shapes costs
the node one template boot at a time, and the store's caps (template_max_count,
template_max_mib) bound what is kept. The templates pods' shims make are bounded too, per
hour on the node and per pod author (shim/vm/template/ledger.py): a pod over the bound
runs as booted, and no template of its shape is made."""
from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import os
import re
import tempfile
import time
from typing import Callable

import cgroups
from cgroups import CgroupLimits, SandboxCgroup, SandboxLayout

from ...config import HypervisorConfig
from ...host.capacity import capacity
from ...host.cleanup import remove_parent_if_empty
from ...host.podstate import CgroupState
from ...network.model import PlaceholderNic
from ..hypervisor import RestoreFailed, VMSpec
from . import cache, ledger, store, template as templates

log = logging.getLogger("podvm.templatemaker")

Record = Callable[[CgroupState | None], None]

MAKING = "making"
"""The store's lock that one maker holds on a node while it makes any template."""
VMM_MIB = 256
"""What QEMU takes beside the guest's memory while it boots and saves, under TCG too."""
DEFAULT_MTU = 1500
SHAPE = re.compile(r"(\d+):(\d+)(?::(\d+)(?::(\d+))?)?")
WARM_WAIT_S = 600.0
"""How long `warm` waits for another maker on the node (a pod's shim making its shape's
template) before it says the shape is not warmed."""


class TemplatesOff(Exception):
    """This configuration keeps no templates: nothing to warm (the reason in words)."""


class Result(enum.Enum):
    MADE = "made"
    EXISTS = "exists"
    BUSY = "busy"
    """Someone on the node is making this template, or another one, now."""
    NO_ROOM = "no room"
    TRIMMED = "trimmed"
    """Made, and then trimmed by the store's caps at once."""
    BOUNDED = "bounded"
    """Not made: the pod's namespace, or the node, started its bound of new shapes in
    the last hour (shim/vm/template/ledger.py)."""


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What `make` did: its kind, for code; its line, for people."""
    result: Result
    line: str

    @property
    def ready(self) -> bool:
        """The template is there for the next pod."""
        return self.result in (Result.MADE, Result.EXISTS)


@dataclasses.dataclass(frozen=True)
class Shape:
    """A pod's VM as the template sees it: vCPUs and MiB at boot, NICs and their MTU."""
    vcpus: int
    memory_mib: int
    nics: int = 1
    mtu: int = DEFAULT_MTU

    @classmethod
    def parse(cls, text: str) -> "Shape":
        """VCPUS:MIB[:NICS[:MTU]], e.g. 1:256 (one NIC at MTU 1500) or 1:256:0."""
        found = SHAPE.fullmatch(text.strip())
        if not found:
            raise ValueError(f"{text!r}: a shape is VCPUS:MIB[:NICS[:MTU]], e.g. 1:256:1:1500")
        vcpus, mib, nics, mtu = (int(g) if g is not None else None for g in found.groups())
        shape = cls(vcpus, mib, 1 if nics is None else nics, mtu or DEFAULT_MTU)
        if not (shape.vcpus >= 1 and shape.memory_mib >= 64 and 0 <= shape.nics <= 8
                and 576 <= shape.mtu <= 65535):
            raise ValueError(f"{text!r}: want at least 1 vCPU and 64 MiB, 0-8 NICs, an MTU "
                             f"of 576-65535")
        return shape


def default_shape(q: HypervisorConfig, nics: int = 1, mtu: int = DEFAULT_MTU) -> Shape:
    """A pod that asks for nothing, on one pod network (the common CNI MTU)."""
    return Shape(q.default_vcpus, q.default_memory, nics, mtu)


def spec_of(q: HypervisorConfig, shape: Shape, workdir: str) -> VMSpec:
    """The template VM of `shape` as a pod of it would have it (before its class is
    taken: templates.base_of): its maxima are the plan's (shim/resources/model.py),
    the configuration's, else this host's."""
    host = capacity()
    max_vcpus = q.default_maxvcpus or host.cpus
    max_memory = q.default_maxmemory or host.memory_mib
    spec = VMSpec(sandbox_id=f"warm-{os.getpid()}", workdir=workdir, shared_dir=workdir,
                  vcpus=min(shape.vcpus, max_vcpus), max_vcpus=max_vcpus,
                  memory_mib=shape.memory_mib, max_memory_mib=max_memory,
                  hypervisor=q, config_source="podvmctl templates warm",
                  nics=tuple(PlaceholderNic(i, shape.mtu) for i in range(shape.nics)))
    return templates.base_of(spec, q.default_vcpus, q.default_memory)


def refusal(q: HypervisorConfig) -> str:
    """Why this configuration keeps no templates; "" when it keeps them."""
    if not q.enable_template:
        return "enable_template = false"
    return store.refusal(q.template_path)


def class_of(spec: VMSpec) -> VMSpec | None:
    """The shape whose template `spec` (a pod's VM, its NICs attached) restores; None when
    this configuration keeps no templates."""
    q = spec.hypervisor
    if refusal(q):
        return None
    return templates.base_of(spec, q.default_vcpus, q.default_memory)


async def make(shape: VMSpec, record: Record | None = None,
               namespace: str | None = None) -> Outcome:
    """Make `shape`'s template unless there is one, or someone is making a template on
    this node now. Errors are the boot's (a broken guest image) or templates.NotSaved.
    `record`: told the template's cgroup before it is made, and None once it is gone (a
    pod's shim keeps it in sandbox.json, for `delete` after a crash). `namespace`: the
    pod author a pod's shim makes it for, its make counted and bounded (ledger.charge)
    before any template is evicted for it; None for the operator's (`warm`)."""
    q = shape.hypervisor
    template = templates.of(shape)
    exists = Outcome(Result.EXISTS, f"template {template.key} exists")
    if template.exists():
        return exists
    os.makedirs(q.template_path, mode=0o700, exist_ok=True)
    slot = store.lock(q.template_path, MAKING)
    if slot < 0:
        return Outcome(Result.BUSY, "another template is being made on this node")
    try:
        lock = template.lock()
        if lock is None:
            return Outcome(Result.BUSY, f"template {template.key} is being made")
        try:
            if template.exists():
                return exists
            if namespace is not None:
                over = ledger.charge(q.template_path,
                                     ledger.Make(time.time(), namespace, template.key),
                                     ledger.Bounds(q.template_new_per_hour,
                                                   q.template_new_per_namespace_per_hour))
                if over:
                    return Outcome(Result.BOUNDED, over)
            if not store.make_room(q.template_path, shape.memory_mib << 20,
                                           q.template_max_count, q.template_max_mib << 20):
                return Outcome(Result.NO_ROOM, "no room for a template (template_max_count, "
                                               "template_max_mib, disk)")
            await _make_in_cgroup(template, shape, record)
        finally:
            lock.release()
    finally:
        os.close(slot)
    if template.exists():
        return Outcome(Result.MADE, f"template {template.key} made")
    return Outcome(Result.TRIMMED,
                   f"template {template.key} made and then trimmed (template_max_mib)")


async def _make_in_cgroup(template: templates.Template, shape: VMSpec,
                          record: Record | None) -> None:
    q = shape.hypervisor
    manager = cgroups.detect()
    limits = CgroupLimits(cpu_shares=cache.CPU_SHARES if manager.version == 1 else None,
                          memory_limit_bytes=(shape.memory_mib + VMM_MIB) << 20,
                          devices=cgroups.QEMU_DEVICES if manager.version == 1 else None)
    state = CgroupState(manager=manager.to_state(),
                        layout=SandboxLayout(q.template_cgroup, f"template-{template.key[:16]}"))
    if record is not None:
        record(state)
    cgroup = SandboxCgroup.create(state.layout, limits, manager)
    try:
        await template.make(shape, cgroup.preexec(), q.template_max_count,
                            q.template_max_mib << 20)
    finally:
        cgroup.destroy()
        remove_parent_if_empty(state)
        if record is not None:
            record(None)
    if template.exists():  # for the next pod, which copies it from RAM
        try:
            saved = template.saved()
        except RestoreFailed as exc:  # a restore finds it too, and discards it
            log.warning("%s", exc)
            return
        await cache.warm(q, saved.memory, saved.memory_digests)


async def make_in_background(shape: VMSpec, sandbox_id: str, record: Record,
                             namespace: str) -> None:
    """For a pod that booted, of Kubernetes namespace `namespace`: its shape's template,
    for the next pod of the shape, within the bounds on new shapes. Never raises: the
    pod runs on whatever happens here (cancelled when the pod goes)."""
    try:
        outcome = await make(shape, record, namespace)
    except asyncio.CancelledError:
        log.info("sandbox %s: template of its shape not made: the pod went first",
                 sandbox_id)
        raise
    except Exception as exc:
        log.warning("sandbox %s: template of its shape not made: %s", sandbox_id, exc)
        return
    if outcome.result is Result.BOUNDED:
        log.warning("sandbox %s: template of its shape not made: %s", sandbox_id,
                    outcome.line)
        return
    log.info("sandbox %s: %s in the background", sandbox_id, outcome.line)


async def warm(q: HypervisorConfig, shapes: list[Shape],
               wait_s: float = WARM_WAIT_S) -> list[Outcome]:
    """`podvmctl templates warm`: each shape's template made unless it exists, its line
    led by the shape. Waits up to `wait_s` for a maker already at work (a pod's shim)
    rather than skipping the shape. TemplatesOff where the configuration keeps none. The
    store is pruned first (store.prune)."""
    off = refusal(q)
    if off:
        raise TemplatesOff(off)
    store.prune(q.template_path)  # what changed or a killed maker left goes first
    outcomes = []
    with tempfile.TemporaryDirectory(prefix="podvm-warm-") as work:
        for shape in shapes:
            spec = spec_of(q, shape, os.path.join(work, f"{shape.vcpus}-{shape.memory_mib}"))
            # 9p exports it (empty: a template mounts no share); shapes of one size share it
            os.makedirs(spec.shared_dir, exist_ok=True)
            deadline = asyncio.get_running_loop().time() + wait_s
            outcome = await make(spec)
            while outcome.result is Result.BUSY and \
                    asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.5)
                outcome = await make(spec)
            if outcome.result is Result.BUSY:
                outcome = dataclasses.replace(
                    outcome, line=f"{outcome.line}: not warmed after {wait_s:.0f} s")
            name = f"{shape.vcpus}:{shape.memory_mib}:{shape.nics}:{shape.mtu}"
            outcomes.append(dataclasses.replace(outcome, line=f"{name}: {outcome.line}"))
    return outcomes
