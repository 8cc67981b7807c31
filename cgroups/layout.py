"""Where a sandbox's cgroups are (docs/design.md, "Sandbox cgroup layout"): one sandbox cgroup
under the pod cgroup holds every host thread of the VM, `vcpus/` splits the vCPU threads
from the rest (`vmm/`) so the two can get different CPUs. Pure: no I/O."""
from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from .errors import CgroupPathError
from .paths import check_component, parse_cgroupfs_path, parse_cgroups_path

SANDBOX_PREFIX = "podvm_"
VCPUS = "vcpus"
VMM = "vmm"
CHILDREN = (VCPUS, VMM)
VCPU_ROLE = "vcpu"

# containerd's identifier rule: the id ends up in a directory name.
_SANDBOX_ID = re.compile(r"[A-Za-z0-9]+(?:[._-][A-Za-z0-9]+)*")
_MAX_ID = 76


def child_for_role(role: str | enum.Enum) -> str:
    """vCPU threads go to vcpus/, every other thread of the VMM (main loop, I/O threads,
    workers, anything new) to vmm/."""
    name = role.value if isinstance(role, enum.Enum) else role
    if not isinstance(name, str) or not name:
        raise ValueError(f"thread role {role!r} is not a role name")
    return VCPUS if name == VCPU_ROLE else VMM


def role_name(role: str | enum.Enum) -> str:
    name = role.value if isinstance(role, enum.Enum) else role
    child_for_role(name)
    return str(name)


@dataclass(frozen=True)
class SandboxLayout:
    """Paths are absolute inside a hierarchy (the same string in every v1 hierarchy)."""

    pod_cgroup: str
    sandbox_id: str

    def __post_init__(self) -> None:
        if self.pod_cgroup != "/":
            parse_cgroupfs_path(self.pod_cgroup)
        if len(self.sandbox_id) > _MAX_ID or not _SANDBOX_ID.fullmatch(self.sandbox_id):
            raise CgroupPathError(f"sandbox id {self.sandbox_id!r} is not a containerd id "
                                  f"(letters, digits, '.', '_', '-'; at most {_MAX_ID})")
        check_component(SANDBOX_PREFIX + self.sandbox_id, self.pod_cgroup)

    @classmethod
    def from_cgroups_path(cls, cgroups_path: str, sandbox_id: str) -> SandboxLayout:
        """From the sandbox container's `linux.cgroupsPath` (either syntax): its parent is
        the pod cgroup kubelet made."""
        return cls(pod_cgroup=parse_cgroups_path(cgroups_path).parent, sandbox_id=sandbox_id)

    @property
    def sandbox(self) -> str:
        return f"{self.pod_cgroup.rstrip('/')}/{SANDBOX_PREFIX}{self.sandbox_id}"

    @property
    def vcpus(self) -> str:
        return f"{self.sandbox}/{VCPUS}"

    @property
    def vmm(self) -> str:
        return f"{self.sandbox}/{VMM}"

    def child(self, name: str) -> str:
        if name not in CHILDREN:
            raise ValueError(f"no child cgroup {name!r} in the sandbox layout")
        return f"{self.sandbox}/{name}"

    def ancestors(self) -> list[str]:
        """The pod cgroup and every cgroup above it, nearest first, ending with '/'."""
        out = []
        path = self.pod_cgroup
        while path != "/":
            out.append(path)
            path = path.rsplit("/", 1)[0] or "/"
        out.append("/")
        return out

    def to_state(self) -> dict[str, str]:
        return {"pod_cgroup": self.pod_cgroup, "sandbox_id": self.sandbox_id}

    @classmethod
    def from_state(cls, state: dict[str, str]) -> SandboxLayout:
        return cls(pod_cgroup=state["pod_cgroup"], sandbox_id=state["sandbox_id"])
