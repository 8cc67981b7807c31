"""sandbox.json: what a pod's shim made on the host, recorded before it makes it, so that
`delete` after a crash and `podvmctl status` find it from the file alone. One frozen
value: a change is a new value (dataclasses.replace), saved whole and atomically; a file
that is not this shape, or of a version this podvm does not know, is refused by name."""
from __future__ import annotations

import json
import os
import types
from dataclasses import dataclass, field
from typing import Any, Mapping

from podvm_core.atomic import write_json

from cgroups import SandboxLayout

from ..dataclassjson import ShapeError, dataclass_from_json, to_json
from ..network.model import PodNetwork
from ..resources import SandboxPlan
from . import paths

STATE_FILE = paths.POD_STATE_FILE
VERSION = 1
"""Raised whenever a field's meaning changes; a reader refuses versions it does not know."""


class PodStateError(ValueError):
    """The state file is not one this podvm wrote; the message names it."""


@dataclass(frozen=True)
class CgroupState:
    manager: Mapping[str, Any]
    """The host's hierarchies as the cgroups package describes them
    (`cgroups.manager_from_state()` rebuilds the manager without probing)."""
    layout: SandboxLayout
    overhead: SandboxLayout | None = None
    """sandbox_cgroup_only = false: the shim's own cgroup, outside the pod."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "manager", types.MappingProxyType(dict(self.manager)))


@dataclass(frozen=True)
class VMReport:
    """What the guest and QEMU last said the VM has, for `podvmctl status` (which cannot
    ask QMP: the shim holds its only connection)."""
    online_cpus: int
    memory_total_mib: int
    at: float
    """time.time() of the report."""
    qemu_vcpus: int | None = None
    qemu_memory_mib: int | None = None


@dataclass(frozen=True)
class PodState:
    sandbox_id: str
    cgroup: CgroupState
    plan: SandboxPlan
    """The plan in force."""
    qmp_socket: str = ""
    """On the command line of the pod's QEMU: how a workload container's delete finds the
    pod's mount namespace (cleanup.py); the sandbox's own delete takes every QEMU of the
    state directory."""
    qemu_pid: int = 0
    qemu_start_time: int | None = None
    """processes.start_time() of qemu_pid: tells it from a process that got its pid later."""
    scratch_inode: int = 0
    """The inode of the pod's scratch disk, an unnamed file QEMU holds (0: none yet), by
    which the node finds what it takes (shim/host/diskreserve.py)."""
    qemu_jail_id: int | None = None
    """The uid and gid QEMU runs as (shim/host/jailids.py; None: not jailed); `delete`
    drops its claim after a crash."""
    rootfs: Mapping[str, str] = field(default_factory=dict)
    """Container id -> its bundle's rootfs, mounted by the shim."""
    vcpu_pins: tuple[str, ...] = ()
    """Host CPUs of each vCPU by index (CPU lists; empty: floating)."""
    vm: VMReport | None = None
    netns: str = ""
    """The pod's network namespace (containerd's; "" for none): recorded before anything
    is done in it, so that `delete` can undo podvm's taps and redirects there."""
    network: PodNetwork | None = None
    """What CNI configured in it, as bridged into the VM."""
    taps: tuple[str, ...] = ()
    """podvm's taps in the namespace."""
    restored_from: str = ""
    """The key of the template the VM was restored from; "" when it booted."""
    pod_name: str = ""
    pod_namespace: str = ""
    """Kubernetes' name for the pod ("" outside Kubernetes), for podvm_node/collect.py's
    metric labels."""
    boot_seconds: float = 0.0
    """From QEMU's launch (or restore) to the guest agent's first answer; 0 before."""
    agent_rtt_seconds: float = 0.0
    """One Ping round trip to the guest agent once it is up; 0 before."""
    guest_oom_kills: int = 0
    """Containers the guest's OOM killer ended, as the agent reported them."""
    template_cgroup: CgroupState | None = None
    """The cgroup of the template this pod's shim is making (shim/vm/template/maker.py),
    recorded before it is made: `delete` removes it after a crash."""
    version: int = VERSION

    def __post_init__(self) -> None:
        object.__setattr__(self, "rootfs", types.MappingProxyType(dict(self.rootfs)))

    def to_json(self) -> dict:
        data = to_json(self)
        assert isinstance(data, dict)
        return {"version": data.pop("version"), **data}  # first, for a reader of the file

    @classmethod
    def from_json(cls, data: object, where: str = STATE_FILE) -> PodState:
        """PodStateError, naming `where`, for anything but this version's shape."""
        if not isinstance(data, dict) or "version" not in data:
            raise PodStateError(f"{where}: not a podvm pod state (no version field)")
        if data["version"] != VERSION:
            raise PodStateError(f"{where}: pod state version {data['version']!r} is not the "
                                f"one this podvm knows ({VERSION}): written by another podvm")
        try:
            return dataclass_from_json(cls, data, where)
        except ShapeError as exc:
            raise PodStateError(str(exc)) from None

    def save(self, path: str) -> None:
        """Replace the file whole: a crash leaves the old state or the new."""
        write_json(path, self.to_json(), indent=1)

    @classmethod
    def load(cls, path: str) -> PodState:
        """FileNotFoundError when there is none; PodStateError when it is not valid."""
        with open(path, "rb") as f:
            text = f.read()
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise PodStateError(f"{path}: not JSON ({exc})") from None
        return cls.from_json(data, path)


def state_path(state_dir: str) -> str:
    return os.path.join(state_dir, STATE_FILE)
