"""cgroup v1: one hierarchy per controller (or per co-mounted group). Each thread can sit
in a different cgroup per hierarchy, so vCPU threads are sorted in the cpu, cpuacct and
cpuset hierarchies only, while the whole process stays in the sandbox cgroup for memory,
pids and devices."""
from __future__ import annotations

import os
from typing import Iterable, Mapping

from .errors import CgroupError, InvalidLimits, ProcessGone
from .fs import (NewDirectories, Transaction, evacuate, read_ids, read_optional, read_value,
                 remove_dir, write_id, write_value)
from .layout import CHILDREN, VCPUS, VMM, SandboxLayout
from .limits import (DEFAULT_PERIOD_US, DEFAULT_SHARES, CgroupLimits, format_cpu_list,
                     or_max, parse_cpu_list)
from .manager import CgroupManager
from .mounts import MOUNTINFO, PROC_CGROUPS, Hierarchy, host_hierarchies
from .procs import thread_cgroups
from .report import LimitsReport

UNLIMITED_MEMORY_FLOOR = 1 << 62
"""memory.limit_in_bytes reads back as PAGE_COUNTER_MAX pages when unlimited; anything this
large is no real limit."""
CPUSET_FILES = ("cpuset.cpus", "cpuset.mems")
REPORT_FILES = ("cpu.cfs_quota_us", "cpu.cfs_period_us", "cpu.shares", "cpuacct.usage",
                "memory.limit_in_bytes", "memory.usage_in_bytes", "pids.max", "pids.current",
                "cpuset.cpus", "cpuset.mems", "cpuset.effective_cpus", "devices.list")


class CgroupV1Manager(CgroupManager):
    version = 1
    SANDBOX_CONTROLLERS = frozenset({"cpu", "cpuacct", "memory", "pids", "cpuset", "devices"})
    SPLIT_CONTROLLERS = frozenset({"cpu", "cpuacct", "cpuset"})

    def __init__(self, hierarchies: Iterable[Hierarchy]) -> None:
        self.hierarchies: tuple[Hierarchy, ...] = tuple(
            h for h in hierarchies if h.version == 1 and h.controllers & self.SANDBOX_CONTROLLERS)
        if not self.hierarchies:
            raise CgroupError("no cgroup v1 hierarchy with any of "
                              f"{', '.join(sorted(self.SANDBOX_CONTROLLERS))}")

    @classmethod
    def from_host(cls, mountinfo: str = MOUNTINFO,
                  proc_cgroups: str = PROC_CGROUPS) -> CgroupV1Manager:
        return cls(host_hierarchies(mountinfo, proc_cgroups))

    @property
    def controllers(self) -> frozenset[str]:
        found: set[str] = set()
        for h in self.hierarchies:
            found |= h.controllers
        return frozenset(found & self.SANDBOX_CONTROLLERS)

    def describe(self) -> str:
        return "cgroup v1 " + ", ".join(
            f"{h.mountpoint} ({','.join(sorted(h.controllers))})" for h in self.hierarchies)

    def _hierarchy(self, controller: str) -> Hierarchy | None:
        for h in self.hierarchies:
            if controller in h.controllers:
                return h
        return None

    def _split(self, h: Hierarchy) -> bool:
        return bool(h.controllers & self.SPLIT_CONTROLLERS)

    def _paths(self, h: Hierarchy, layout: SandboxLayout) -> list[str]:
        """The sandbox's cgroups in one hierarchy, children first."""
        children = [layout.child(c) for c in CHILDREN] if self._split(h) else []
        return children + [layout.sandbox]

    def _dir(self, controller: str, path: str) -> str:
        h = self._hierarchy(controller)
        assert h is not None
        return h.directory(path)

    def hierarchy_keys(self) -> frozenset[str]:
        keys: set[str] = set()
        for h in self.hierarchies:
            keys |= h.controllers
        return frozenset(keys)

    def expected_cgroups(self, layout: SandboxLayout, child: str | None) -> dict[str, str]:
        out = {}
        for h in self.hierarchies:
            path = layout.child(child) if child and self._split(h) else layout.sandbox
            for controller in h.controllers:
                out[controller] = path
        return out

    def create(self, layout: SandboxLayout) -> None:
        with NewDirectories() as dirs:
            for h in self.hierarchies:
                pod_levels = [p for p in reversed(layout.ancestors()) if h.below_root(p)]
                for path in pod_levels + self._paths(h, layout)[::-1]:
                    dirs.make(h.directory(path))
                    if "cpuset" in h.controllers:
                        _inherit_cpuset(h.directory(path), h.directory(_parent(path)))

    def exists(self, layout: SandboxLayout) -> bool:
        return any(os.path.isdir(h.directory(layout.sandbox)) for h in self.hierarchies)

    def procs_files(self, layout: SandboxLayout) -> list[str]:
        return [os.path.join(h.directory(layout.sandbox), "cgroup.procs")
                for h in self.hierarchies]

    def place_process(self, layout: SandboxLayout, pid: int) -> None:
        before = thread_cgroups(pid, pid)
        if before is None:
            raise ProcessGone(f"process {pid} has exited before it could be placed")
        moved: list[Hierarchy] = []
        try:
            for h in self.hierarchies:
                write_id(os.path.join(h.directory(layout.sandbox), "cgroup.procs"), pid)
                moved.append(h)
        except CgroupError:
            for h in moved:  # nothing half-placed: back where it was
                origin = before.get(next(iter(h.controllers)))
                if origin is not None:
                    try:
                        write_id(os.path.join(h.directory(origin), "cgroup.procs"), pid)
                    except CgroupError:
                        pass
            raise

    def return_process(self, pid: int, cgroups: Mapping[str, str]) -> None:
        for h in self.hierarchies:
            path = next((cgroups[c] for c in sorted(h.controllers) if c in cgroups), None)
            if path is not None:
                write_id(os.path.join(h.directory(path), "cgroup.procs"), pid)

    def move_thread(self, layout: SandboxLayout, child: str, tid: int) -> bool:
        for h in self.hierarchies:
            if self._split(h):
                try:
                    write_id(os.path.join(h.directory(layout.child(child)), "tasks"), tid)
                except ProcessGone:
                    return False
        return True

    def apply(self, layout: SandboxLayout, limits: CgroupLimits) -> None:
        self.check_available(limits, layout.sandbox + f" ({self.describe()})")
        have = self.controllers
        cpuset = self._cpuset_targets(layout, limits) if "cpuset" in have else None
        with Transaction() as tx:
            if "cpu" in have:
                self._apply_cpu(tx, self._dir("cpu", layout.sandbox), limits)
            if "memory" in have:
                value = limits.memory_limit_bytes
                tx.write(os.path.join(self._dir("memory", layout.sandbox),
                                      "memory.limit_in_bytes"),
                         "-1" if value is None else str(value))
            if "pids" in have:
                tx.write_if_changed(os.path.join(self._dir("pids", layout.sandbox), "pids.max"),
                                    or_max(limits.pids_limit))
            if cpuset is not None:
                self._apply_cpuset(tx, layout, cpuset)
            if "devices" in have:
                self._apply_devices(tx, self._dir("devices", layout.sandbox), limits)

    def _apply_cpu(self, tx: Transaction, directory: str, limits: CgroupLimits) -> None:
        quota_file = os.path.join(directory, "cpu.cfs_quota_us")
        period_file = os.path.join(directory, "cpu.cfs_period_us")
        period = limits.cpu_period_us or DEFAULT_PERIOD_US
        quota = limits.cpu_quota_us if limits.cpu_quota_us is not None else -1
        if int(read_value(period_file)) != period:
            # A period change next to the old quota can exceed the parent's ratio for a
            # moment, which v1 refuses: go through "no quota" (always accepted).
            tx.write_if_changed(quota_file, "-1")
            tx.write_if_changed(period_file, str(period))
        tx.write_if_changed(quota_file, str(quota))
        tx.write_if_changed(os.path.join(directory, "cpu.shares"),
                          str(limits.cpu_shares or DEFAULT_SHARES))

    def _cpuset_targets(self, layout: SandboxLayout,
                        limits: CgroupLimits) -> dict[str, dict[str, str]]:
        """File -> child -> value; vmm/ may have CPUs of its own (vmm_cpuset_cpus)."""
        pod = self._dir("cpuset", layout.pod_cgroup)
        targets: dict[str, dict[str, str]] = {}
        for name, wanted in zip(CPUSET_FILES, (limits.cpuset_cpus, limits.cpuset_mems)):
            allowed_text = read_value(os.path.join(pod, name))
            own = limits.vmm_cpuset_cpus if name == "cpuset.cpus" else None
            for value in (wanted, own):
                extra = parse_cpu_list(value or "") - parse_cpu_list(allowed_text)
                if extra:
                    raise InvalidLimits(f"{name} {value!r} is not within the pod cgroup's "
                                        f"{allowed_text!r} ({os.path.join(pod, name)})")
            shared = wanted if wanted is not None else allowed_text
            targets[name] = {VCPUS: shared, VMM: own if own is not None else shared}
        return targets

    def _apply_cpuset(self, tx: Transaction, layout: SandboxLayout,
                      targets: dict[str, dict[str, str]]) -> None:
        """A child's cpuset must stay within its parent's at every step: widen the sandbox
        to old + new, set the children, then narrow the sandbox to the children's union."""
        sandbox = self._dir("cpuset", layout.sandbox)
        for name, by_child in targets.items():
            current = parse_cpu_list(read_value(os.path.join(sandbox, name)))
            new = frozenset().union(*(parse_cpu_list(v) for v in by_child.values()))
            tx.write_if_changed(os.path.join(sandbox, name), format_cpu_list(current | new))
            for child, value in by_child.items():
                tx.write_if_changed(os.path.join(self._dir("cpuset", layout.child(child)), name),
                                    format_cpu_list(parse_cpu_list(value)))
            tx.write_if_changed(os.path.join(sandbox, name), format_cpu_list(new))

    def _apply_devices(self, tx: Transaction, directory: str, limits: CgroupLimits) -> None:
        current = _device_list(directory)
        wanted = ("a *:* rwm",) if limits.devices is None else tuple(r.line for r in limits.devices)
        if sorted(current) == sorted(wanted):
            return
        tx.step(lambda: _set_devices(directory, wanted), lambda: _set_devices(directory, current))

    def read_limits(self, layout: SandboxLayout) -> LimitsReport:
        have = self.controllers
        values: dict[str, object] = {}
        if "cpu" in have:
            d = self._dir("cpu", layout.sandbox)
            quota = int(read_value(os.path.join(d, "cpu.cfs_quota_us")))
            values.update(cpu_quota_us=None if quota < 0 else quota,
                          cpu_period_us=int(read_value(os.path.join(d, "cpu.cfs_period_us"))),
                          cpu_shares=int(read_value(os.path.join(d, "cpu.shares"))))
        if "memory" in have:
            limit = int(read_value(os.path.join(self._dir("memory", layout.sandbox),
                                                "memory.limit_in_bytes")))
            values["memory_limit_bytes"] = None if limit >= UNLIMITED_MEMORY_FLOOR else limit
        if "pids" in have:
            text = read_value(os.path.join(self._dir("pids", layout.sandbox), "pids.max"))
            values["pids_limit"] = None if text == "max" else int(text)
        if "cpuset" in have:
            d = self._dir("cpuset", layout.sandbox)
            values.update(cpuset_cpus=read_value(os.path.join(d, "cpuset.cpus")) or None,
                          cpuset_mems=read_value(os.path.join(d, "cpuset.mems")) or None)
        if "devices" in have:
            values["devices"] = _device_list(self._dir("devices", layout.sandbox))
        return LimitsReport(**values)  # type: ignore[arg-type]

    def read_files(self, layout: SandboxLayout) -> dict[str, dict[str, str]]:
        out: dict[str, dict[str, str]] = {}
        for h in self.hierarchies:
            for path in reversed(self._paths(h, layout)):
                directory = h.directory(path)
                files = {}
                for name in REPORT_FILES:
                    if name.split(".")[0] in h.controllers:
                        value = read_optional(os.path.join(directory, name))
                        if value is not None:
                            files[name] = value
                if os.path.isdir(directory):
                    out[directory] = files
        return out

    def member_threads(self, layout: SandboxLayout) -> list[int]:
        tids: set[int] = set()
        for h in self.hierarchies:
            for path in self._paths(h, layout):
                tids.update(read_ids(os.path.join(h.directory(path), "tasks")))
        return sorted(tids)

    def destroy(self, layout: SandboxLayout, move_to: str | None = None) -> bool:
        removed = False
        for h in self.hierarchies:
            target = os.path.join(h.directory(move_to or layout.pod_cgroup), "tasks")
            for path in self._paths(h, layout):
                directory = h.directory(path)
                if not os.path.isdir(directory):
                    continue
                _evacuate(os.path.join(directory, "tasks"), target)
                removed = remove_dir(directory) or removed
        return removed

    def to_state(self) -> dict:
        return {"version": 1, "hierarchies": [h.to_state() for h in self.hierarchies]}


def _parent(path: str) -> str:
    return path.rsplit("/", 1)[0] or "/"


def _inherit_cpuset(directory: str, parent: str) -> None:
    """A new v1 cpuset cgroup starts with no CPUs and no memory nodes and accepts no task
    until both are set; copy them from the parent, as runc does."""
    for name in CPUSET_FILES:
        path = os.path.join(directory, name)
        if not read_value(path):
            write_value(path, read_value(os.path.join(parent, name)))


def _device_list(directory: str) -> tuple[str, ...]:
    return tuple(read_value(os.path.join(directory, "devices.list")).splitlines())


def _set_devices(directory: str, lines: tuple[str, ...]) -> None:
    if lines == ("a *:* rwm",):
        write_value(os.path.join(directory, "devices.allow"), "a")
        return
    write_value(os.path.join(directory, "devices.deny"), "a")
    for line in lines:
        write_value(os.path.join(directory, "devices.allow"), line)


def _evacuate(tasks_file: str, target: str) -> None:
    """Move every task out (none is killed), until none is left."""
    def move(tid: int) -> None:
        try:
            write_id(target, tid)
        except ProcessGone:
            pass

    evacuate(lambda: read_ids(tasks_file), move, tasks_file)
