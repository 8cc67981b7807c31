"""cgroup v2: one hierarchy, and a process's threads may only be split inside a threaded
subtree. The sandbox cgroup is a domain holding the process (memory, pids and io are
charged there); vcpus/ and vmm/ are threaded children (cpu, cpuset) that threads enter
through cgroup.threads. Writing a thread id to cgroup.procs would move the whole process,
the mistake Kata makes on v2."""
from __future__ import annotations

import errno
import os
from typing import Mapping

from .errors import CgroupError, CgroupIOError, InvalidLimits, ProcessGone
from .fs import (NewDirectories, Transaction, evacuate, read_ids, read_optional, read_value,
                 remove_dir, write_id, write_value)
from .layout import CHILDREN, VMM, SandboxLayout
from .limits import DEFAULT_PERIOD_US, CgroupLimits, format_cpu_list, or_max, parse_cpu_list
from .manager import CgroupManager
from .mounts import Hierarchy
from .procs import UNIFIED, process_of
from .report import LimitsReport

DEFAULT_WEIGHT = 100
THREADED = "threaded"
SANDBOX_FILES = ("cgroup.type", "cgroup.controllers", "cgroup.subtree_control", "cpu.max",
                 "cpu.weight", "memory.max", "memory.current", "pids.max", "pids.current",
                 "cpuset.cpus", "cpuset.mems", "cpuset.cpus.effective")
CHILD_FILES = ("cgroup.type", "cgroup.controllers", "cpu.weight", "cpuset.cpus",
               "cpuset.cpus.effective")
# Where a process cannot go: a domain with controllers enabled for its children (the
# no-internal-process rule) or a threaded cgroup.
_REFUSED_HERE = (errno.EBUSY, errno.EOPNOTSUPP, errno.EINVAL)


class CgroupV2Manager(CgroupManager):
    version = 2
    SANDBOX_CONTROLLERS = frozenset({"cpu", "cpuset", "memory", "pids", "io"})
    SPLIT_CONTROLLERS = frozenset({"cpu", "cpuset"})

    def __init__(self, mountpoint: str = "/sys/fs/cgroup", root: str = "/") -> None:
        self.hierarchy = Hierarchy(mountpoint=mountpoint, root=root,
                                   controllers=frozenset(), version=2)
        if not os.path.isfile(os.path.join(mountpoint, "cgroup.controllers")):
            raise CgroupError(f"{mountpoint} is not a cgroup2 mount (no cgroup.controllers)")

    @property
    def controllers(self) -> frozenset[str]:
        top = read_value(os.path.join(self.hierarchy.mountpoint, "cgroup.controllers"))
        return frozenset(top.split()) & self.SANDBOX_CONTROLLERS

    def describe(self) -> str:
        return f"cgroup v2 at {self.hierarchy.mountpoint}"

    def _dir(self, path: str) -> str:
        return self.hierarchy.directory(path)

    def hierarchy_keys(self) -> frozenset[str]:
        return frozenset({UNIFIED})

    def expected_cgroups(self, layout: SandboxLayout, child: str | None) -> dict[str, str]:
        return {UNIFIED: layout.child(child) if child else layout.sandbox}

    def create(self, layout: SandboxLayout) -> None:
        domain = sorted(self.controllers)
        threaded = sorted(self.controllers & self.SPLIT_CONTROLLERS)
        with NewDirectories() as dirs:
            # Every level down to the pod cgroup hands the controllers on, as runc does.
            for path in reversed(layout.ancestors()):
                if not self.hierarchy.shows(path):
                    continue
                if self.hierarchy.below_root(path):
                    dirs.make(self._dir(path))
                _enable(self._dir(path), domain)
            sandbox = self._dir(layout.sandbox)
            dirs.make(sandbox)
            for child in CHILDREN:
                directory = self._dir(layout.child(child))
                dirs.make(directory)
                if read_value(os.path.join(directory, "cgroup.type")) != THREADED:
                    write_value(os.path.join(directory, "cgroup.type"), THREADED)
            _enable(sandbox, threaded)

    def exists(self, layout: SandboxLayout) -> bool:
        return os.path.isdir(self._dir(layout.sandbox))

    def procs_files(self, layout: SandboxLayout) -> list[str]:
        return [os.path.join(self._dir(layout.sandbox), "cgroup.procs")]

    def place_process(self, layout: SandboxLayout, pid: int) -> None:
        write_id(os.path.join(self._dir(layout.sandbox), "cgroup.procs"), pid)

    def return_process(self, pid: int, cgroups: Mapping[str, str]) -> None:
        if UNIFIED in cgroups:
            write_id(os.path.join(self._dir(cgroups[UNIFIED]), "cgroup.procs"), pid)

    def move_thread(self, layout: SandboxLayout, child: str, tid: int) -> bool:
        try:
            write_id(os.path.join(self._dir(layout.child(child)), "cgroup.threads"), tid)
        except ProcessGone:
            return False
        return True

    def apply(self, layout: SandboxLayout, limits: CgroupLimits) -> None:
        self.check_available(limits, f"{layout.sandbox} ({self.describe()})")
        have = self.controllers
        sandbox = self._dir(layout.sandbox)
        writes: list[tuple[str, str]] = []
        if "cpu" in have:
            writes.append((os.path.join(sandbox, "cpu.max"), f"{or_max(limits.cpu_quota_us)} "
                           f"{limits.cpu_period_us or DEFAULT_PERIOD_US}"))
            writes.append((os.path.join(sandbox, "cpu.weight"),
                           str(limits.cpu_weight or DEFAULT_WEIGHT)))
        if "memory" in have:
            writes.append((os.path.join(sandbox, "memory.max"),
                           or_max(limits.memory_limit_bytes)))
        if "pids" in have:
            writes.append((os.path.join(sandbox, "pids.max"), or_max(limits.pids_limit)))
        if "cpuset" in have:
            self._check_cpuset(layout, limits)
            writes.extend(self._cpuset_writes(layout, limits))
        with Transaction() as tx:
            for path, text in writes:
                tx.write_if_changed(path, text)

    def _cpuset_writes(self, layout: SandboxLayout,
                       limits: CgroupLimits) -> list[tuple[str, str]]:
        """Last, as the one kind of value that cannot always be put back: the kernel
        refuses to empty the cpuset of a populated cgroup (ENOSPC), so "inherit" ("")
        stays only while nothing was set, and None afterwards means the pod's CPUs.
        v2 does not require a child's set to lie within its parent's."""
        pod = self._dir(layout.pod_cgroup)
        writes = []
        for name, wanted in (("cpuset.cpus", limits.cpuset_cpus),
                             ("cpuset.mems", limits.cpuset_mems)):
            own = limits.vmm_cpuset_cpus if name == "cpuset.cpus" else None
            for path in [layout.sandbox] + [layout.child(c) for c in CHILDREN]:
                target = os.path.join(self._dir(path), name)
                value = wanted
                if path == layout.child(VMM) and own is not None:
                    value = own
                elif path == layout.sandbox and own is not None:
                    value = format_cpu_list(parse_cpu_list(wanted or read_value(
                        os.path.join(pod, f"{name}.effective"))) | parse_cpu_list(own))
                if value is None:
                    value = read_value(target) and read_value(
                        os.path.join(pod, f"{name}.effective"))
                writes.append((target, value))
        return writes

    def _check_cpuset(self, layout: SandboxLayout, limits: CgroupLimits) -> None:
        """v2 would silently run the sandbox on its parent's CPUs if none of the wanted
        ones is there; refuse instead."""
        pod = self._dir(layout.pod_cgroup)
        for name, wanted in (("cpuset.cpus", limits.cpuset_cpus),
                             ("cpuset.vmm", limits.vmm_cpuset_cpus),
                             ("cpuset.mems", limits.cpuset_mems)):
            if wanted is None:
                continue
            name = "cpuset.cpus" if name == "cpuset.vmm" else name
            effective_file = os.path.join(pod, f"{name}.effective")
            allowed = read_value(effective_file)
            extra = parse_cpu_list(wanted) - parse_cpu_list(allowed)
            if extra:
                raise InvalidLimits(f"{name} {wanted!r} is not within the pod cgroup's "
                                    f"{allowed!r} ({effective_file})")

    def read_limits(self, layout: SandboxLayout) -> LimitsReport:
        sandbox = self._dir(layout.sandbox)
        values: dict[str, object] = {}
        cpu_max = read_optional(os.path.join(sandbox, "cpu.max"))
        if cpu_max is not None:
            quota, _, period = cpu_max.partition(" ")
            values.update(cpu_quota_us=None if quota == "max" else int(quota),
                          cpu_period_us=int(period),
                          cpu_weight=int(read_value(os.path.join(sandbox, "cpu.weight"))))
        for field, name in (("memory_limit_bytes", "memory.max"), ("pids_limit", "pids.max")):
            text = read_optional(os.path.join(sandbox, name))
            if text is not None and text != "max":
                values[field] = int(text)
        for field, name in (("cpuset_cpus", "cpuset.cpus"), ("cpuset_mems", "cpuset.mems")):
            text = read_optional(os.path.join(sandbox, name))
            if text:
                values[field] = text
        return LimitsReport(**values)  # type: ignore[arg-type]

    def read_files(self, layout: SandboxLayout) -> dict[str, dict[str, str]]:
        out: dict[str, dict[str, str]] = {}
        for path, names in [(layout.sandbox, SANDBOX_FILES)] + [
                (layout.child(c), CHILD_FILES) for c in CHILDREN]:
            directory = self._dir(path)
            if not os.path.isdir(directory):
                continue
            files = {}
            for name in names:
                value = read_optional(os.path.join(directory, name))
                if value is not None:
                    files[name] = value
            out[directory] = files
        return out

    def member_threads(self, layout: SandboxLayout) -> list[int]:
        tids: set[int] = set()
        for path in [layout.sandbox] + [layout.child(c) for c in CHILDREN]:
            tids.update(read_ids(os.path.join(self._dir(path), "cgroup.threads")))
        return sorted(tids)

    def destroy(self, layout: SandboxLayout, move_to: str | None = None) -> bool:
        paths = [layout.child(c) for c in CHILDREN] + [layout.sandbox]
        if not any(os.path.isdir(self._dir(p)) for p in paths):
            return False
        targets = [move_to] if move_to else [
            p for p in layout.ancestors() if self.hierarchy.shows(p)]
        def pids() -> list[int]:
            owners = (process_of(tid) for tid in self.member_threads(layout))
            return sorted({pid for pid in owners if pid is not None})

        evacuate(pids, lambda pid: self._move_out(pid, targets),
                 f"{layout.sandbox} ({self.describe()})")
        for path in paths:
            remove_dir(self._dir(path))
        return True

    def _move_out(self, pid: int, targets: list[str]) -> None:
        """A whole process (threads cannot leave a threaded subtree alone) into the first
        target that takes processes."""
        last: CgroupIOError | None = None
        for path in targets:
            try:
                write_id(os.path.join(self._dir(path), "cgroup.procs"), pid)
                return
            except ProcessGone:
                return
            except CgroupIOError as err:
                if err.errno not in _REFUSED_HERE:
                    raise
                last = err
        assert last is not None
        raise last

    def to_state(self) -> dict:
        return {"version": 2, "mountpoint": self.hierarchy.mountpoint,
                "root": self.hierarchy.root}


def _enable(directory: str, controllers: list[str]) -> None:
    """Turn controllers on for a cgroup's children, only those not on already (writing to
    a cgroup kubelet made should change nothing it set)."""
    current = set(read_value(os.path.join(directory, "cgroup.subtree_control")).split())
    missing = [c for c in controllers if c not in current]
    if missing:
        write_value(os.path.join(directory, "cgroup.subtree_control"),
                    " ".join(f"+{c}" for c in missing))


