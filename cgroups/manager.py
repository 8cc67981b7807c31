"""The one interface both cgroup versions implement. A manager knows the host's
hierarchies and how a version does each step; it keeps no per-sandbox state, so a new
manager built from persisted state can tear down what a crashed one made."""
from __future__ import annotations

import abc
import enum
from typing import ClassVar, Iterable, Mapping

from .errors import ControllerUnavailable, NotInSandbox
from .layout import CHILDREN, SandboxLayout, child_for_role, role_name
from .limits import CgroupLimits
from .procs import process_of, thread_cgroups
from .report import LimitsReport

OUTSIDE = "outside"
SANDBOX = "sandbox"
MIXED = "mixed"
"""Inside the sandbox in every hierarchy but not sorted the same in all (v1 only)."""


class CgroupManager(abc.ABC):
    version: ClassVar[int]
    SANDBOX_CONTROLLERS: ClassVar[frozenset[str]]
    """Controllers the sandbox cgroup is created in (docs/design.md, Sandbox cgroup layout)."""
    SPLIT_CONTROLLERS: ClassVar[frozenset[str]]
    """Controllers vcpus/ and vmm/ exist in."""

    @property
    @abc.abstractmethod
    def controllers(self) -> frozenset[str]:
        """The SANDBOX_CONTROLLERS this host gives a sandbox: a limit that needs another one
        raises ControllerUnavailable."""

    @abc.abstractmethod
    def describe(self) -> str:
        """Where this manager works, for error messages."""

    @abc.abstractmethod
    def create(self, layout: SandboxLayout) -> None:
        """The sandbox cgroup and its children, and the pod cgroup (parents included) if
        kubelet has not made it; existing directories are reused."""

    @abc.abstractmethod
    def exists(self, layout: SandboxLayout) -> bool:
        """Any directory of the sandbox is left in any hierarchy."""

    @abc.abstractmethod
    def procs_files(self, layout: SandboxLayout) -> list[str]:
        """The cgroup.procs files that put a whole process in the sandbox cgroup."""

    @abc.abstractmethod
    def place_process(self, layout: SandboxLayout, pid: int) -> None:
        """Every thread of `pid` into the sandbox cgroup itself (unsorted)."""

    @abc.abstractmethod
    def return_process(self, pid: int, cgroups: Mapping[str, str]) -> None:
        """Every thread of `pid` back to the cgroups it was in (as thread_cgroups() read
        them before), e.g. a shim leaving its sandbox before the sandbox is removed."""
        raise NotImplementedError

    def move_thread(self, layout: SandboxLayout, child: str, tid: int) -> bool:
        """One thread into vcpus/ or vmm/; False when it has exited meanwhile."""

    @abc.abstractmethod
    def apply(self, layout: SandboxLayout, limits: CgroupLimits) -> None:
        """Make the sandbox's limits equal `limits`: all written, or none (old values are
        put back when the kernel refuses one)."""

    @abc.abstractmethod
    def read_limits(self, layout: SandboxLayout) -> LimitsReport: ...

    @abc.abstractmethod
    def read_files(self, layout: SandboxLayout) -> dict[str, dict[str, str]]: ...

    @abc.abstractmethod
    def member_threads(self, layout: SandboxLayout) -> list[int]:
        """Thread ids in the sandbox cgroup or its children, any hierarchy."""

    @abc.abstractmethod
    def destroy(self, layout: SandboxLayout, move_to: str | None = None) -> bool:
        """Move leftover tasks out (to `move_to`, else the nearest ancestor that takes
        them; nothing is killed), remove the children then the sandbox cgroup. False when
        there was nothing left to remove."""

    @abc.abstractmethod
    def expected_cgroups(self, layout: SandboxLayout, child: str | None) -> dict[str, str]:
        """Where a thread sorted into `child` (None: not sorted yet) shows up in
        /proc/<pid>/task/<tid>/cgroup, for the hierarchies the sandbox uses."""

    @abc.abstractmethod
    def hierarchy_keys(self) -> frozenset[str]:
        """The /proc/<pid>/cgroup keys of the hierarchies the sandbox uses."""

    @abc.abstractmethod
    def to_state(self) -> dict:
        """JSON-able; `cgroups.manager_from_state()` rebuilds an equal manager."""

    def check_available(self, limits: CgroupLimits, where: str) -> None:
        missing: dict[str, list[str]] = {
            controller: fields for controller, fields in limits.controllers().items()
            if controller not in self.controllers}
        if missing:
            raise ControllerUnavailable(sorted(missing), where,
                                        [f for fields in missing.values() for f in fields])

    def thread_cgroups(self, pid: int, tid: int) -> dict[str, str] | None:
        seen = thread_cgroups(pid, tid)
        if seen is None:
            return None
        keys = self.hierarchy_keys()
        return {k: v for k, v in seen.items() if k in keys}

    def location(self, layout: SandboxLayout, cgroups: Mapping[str, str] | None) -> str:
        if cgroups is None:
            return OUTSIDE
        for child in CHILDREN:
            if dict(cgroups) == self.expected_cgroups(layout, child):
                return child
        if dict(cgroups) == self.expected_cgroups(layout, None):
            return SANDBOX
        inside = [p == layout.sandbox or p.startswith(layout.sandbox + "/")
                  for p in cgroups.values()]
        return MIXED if inside and all(inside) else OUTSIDE

    def place_threads(self, layout: SandboxLayout,
                      roles: Mapping[str | enum.Enum, Iterable[int]]) -> dict[str, list[int]]:
        """Role -> the tids moved (threads that exited meanwhile are left out). A thread
        whose process is not in the sandbox is refused: sorting it would leave its
        memory and pids charged elsewhere."""
        plan = [(role_name(role), child_for_role(role), list(tids))
                for role, tids in roles.items()]
        for _, _, tids in plan:  # all checked before any is moved
            for tid in tids:
                self._require_in_sandbox(layout, tid)
        placed: dict[str, list[int]] = {}
        for role, child, tids in plan:
            for tid in tids:
                if self.move_thread(layout, child, tid):
                    placed.setdefault(role, []).append(tid)
        return placed

    def _require_in_sandbox(self, layout: SandboxLayout, tid: int) -> None:
        pid = process_of(tid)
        if pid is None:
            return
        cgroups = self.thread_cgroups(pid, tid)
        if self.location(layout, cgroups) == OUTSIDE:
            raise NotInSandbox(
                f"thread {tid} of process {pid} is not in sandbox cgroup {layout.sandbox} "
                f"({self.describe()}); place_process({pid}) first. It is in {cgroups}")
