"""A sandbox's cgroups as one object: create them, put QEMU in (from its first page),
sort its threads by role, catch the threads it makes later, apply and read back limits,
and tear everything down, also from persisted state after a crash."""
from __future__ import annotations

import enum
import os
import subprocess
import threading
from typing import Any, Callable, Iterable, Mapping, Sequence

from .detect import detect, manager_from_state
from .errors import CgroupError, NotInSandbox, ProcessGone
from .layout import VCPU_ROLE, SandboxLayout, child_for_role
from .limits import CgroupLimits
from .manager import OUTSIDE, SANDBOX, CgroupManager
from .procs import process_of, thread_ids, thread_name
from .report import SandboxReport, ThreadReport

MAIN_ROLE = "main"
NEW_THREAD_ROLE = "other"


class SandboxCgroup:
    """Placement decisions are checked against /proc, not against what was written: the
    kernel is the only record that cannot go stale when threads come and go."""

    def __init__(self, manager: CgroupManager, layout: SandboxLayout) -> None:
        self.manager = manager
        self.layout = layout
        self._pids: set[int] = set()
        self._roles: dict[int, str] = {}

    @classmethod
    def create(cls, layout: SandboxLayout, limits: CgroupLimits | None = None,
               manager: CgroupManager | None = None) -> SandboxCgroup:
        """Limits are checked against the host's controllers before any directory is made;
        when the kernel then refuses one, what this call made is removed again."""
        manager = manager or detect()
        if limits is not None:
            manager.check_available(limits, f"{layout.sandbox} ({manager.describe()})")
        existed = manager.exists(layout)
        manager.create(layout)
        try:
            if limits is not None:
                manager.apply(layout, limits)
        except CgroupError:
            if not existed:
                manager.destroy(layout)
            raise
        return cls(manager, layout)

    def preexec(self) -> Callable[[], None] | None:
        """A `preexec_fn` (subprocess or asyncio) that puts the child into the sandbox
        cgroup before it execs, so every page it touches is charged there. It only makes
        open/write/close system calls, safe enough between fork and exec. None for a
        caller whose thread is in the sandbox cgroup already, in every hierarchy (a shim
        placed there: place_process): a child is born in its parent's cgroups, and the
        write, a move to where it is, would still take the kernel's lock on every cgroup
        move, which waits out an RCU grace period when no move came just before it (5-8
        ms on an idle 2-CPU v1 host, 20 ms and more on a loaded one). What such a caller
        does itself is charged there too."""
        files = self.manager.procs_files(self.layout)
        for path in files:
            if not os.path.exists(path):
                raise CgroupError(f"{path} does not exist: create() the sandbox cgroup first")
        here = self.manager.thread_cgroups(os.getpid(), threading.get_native_id())
        if self.manager.location(self.layout, here) == SANDBOX:
            return None

        def enter_sandbox_cgroup() -> None:
            for path in files:
                fd = os.open(path, os.O_WRONLY)
                try:
                    os.write(fd, b"0")
                finally:
                    os.close(fd)

        return enter_sandbox_cgroup

    def spawn(self, argv: Sequence[str], **popen_kwargs: Any) -> subprocess.Popen:
        """subprocess.Popen, started inside the sandbox cgroup."""
        try:
            proc = subprocess.Popen(argv, preexec_fn=self.preexec(), **popen_kwargs)
        except subprocess.SubprocessError as err:
            raise CgroupError(f"could not start {argv[0]} inside "
                              f"{', '.join(self.manager.procs_files(self.layout))}: "
                              f"{err}") from err
        self._pids.add(proc.pid)
        return proc

    def adopt_process(self, pid: int) -> None:
        """Track a process started elsewhere with preexec(); refused if it is not inside."""
        where = self.manager.location(self.layout, self.manager.thread_cgroups(pid, pid))
        if where == OUTSIDE:
            raise NotInSandbox(f"process {pid} is not in {self.layout.sandbox} "
                               f"({self.manager.describe()})")
        self._pids.add(pid)

    def place_process(self, pid: int) -> None:
        """Every thread of `pid` into the sandbox cgroup (unsorted: sorting comes next)."""
        self.manager.place_process(self.layout, pid)
        self._pids.add(pid)
        for tid in thread_ids(pid):
            self._roles.pop(tid, None)

    def place_threads(self, roles: Mapping[str | enum.Enum, Iterable[int]]
                      ) -> dict[str, list[int]]:
        """`vcpu` threads into vcpus/, every other role into vmm/. Role -> tids moved;
        threads that exited meanwhile are left out."""
        placed = self.manager.place_threads(self.layout, roles)
        for role, tids in placed.items():
            for tid in tids:
                self._roles[tid] = role
        return placed

    def place_new_threads(self, pid: int, vcpus: Iterable[int] = ()) -> dict[str, list[int]]:
        """Re-scan the process and move each thread that is not where its role says:
        `vcpus` (and earlier vCPUs) to vcpus/, everything else, including threads nobody
        has named yet, to vmm/ (a thread starts in its creator's cgroup)."""
        self._forget_exited()
        vcpu_tids = set(vcpus) | {t for t, r in self._roles.items() if r == VCPU_ROLE}
        moves: dict[str | enum.Enum, list[int]] = {}
        for tid in thread_ids(pid):
            if tid in vcpu_tids:
                role = VCPU_ROLE
            else:
                known = self._roles.get(tid)
                role = known if known and known != VCPU_ROLE else (
                    MAIN_ROLE if tid == pid else NEW_THREAD_ROLE)
            where = self.manager.location(self.layout, self.manager.thread_cgroups(pid, tid))
            if where == child_for_role(role):
                self._roles[tid] = role
            else:
                moves.setdefault(role, []).append(tid)
        self._pids.add(pid)
        return self.place_threads(moves) if moves else {}

    def _forget_exited(self) -> None:
        """An unplugged vCPU's thread id may come back as some other thread."""
        for tid in [t for t in self._roles if process_of(t) is None]:
            del self._roles[tid]

    def apply(self, limits: CgroupLimits) -> None:
        self.manager.apply(self.layout, limits)

    def read_back(self) -> SandboxReport:
        """Every thread in the sandbox's cgroups and every thread of a process placed here,
        with its cgroups as the kernel reports them, and the limits read from the files."""
        self._forget_exited()
        pairs: dict[int, int] = {}
        for tid in self.manager.member_threads(self.layout):
            pid = process_of(tid)
            if pid is not None:
                pairs[tid] = pid
        for pid in sorted(self._pids):
            try:
                for tid in thread_ids(pid):
                    pairs.setdefault(tid, pid)
            except ProcessGone:
                self._pids.discard(pid)
        threads = []
        for tid, pid in sorted(pairs.items()):
            cgroups = self.manager.thread_cgroups(pid, tid)
            if cgroups is None:
                continue
            threads.append(ThreadReport(
                pid=pid, tid=tid, name=thread_name(pid, tid), role=self._roles.get(tid),
                cgroups=cgroups, location=self.manager.location(self.layout, cgroups)))
        return SandboxReport(version=self.manager.version, sandbox=self.layout.sandbox,
                             controllers=self.manager.controllers, threads=tuple(threads),
                             limits=self.manager.read_limits(self.layout),
                             files=self.manager.read_files(self.layout))

    def destroy(self, move_to: str | None = None) -> bool:
        """Leftover tasks are moved out (to `move_to`, else the nearest ancestor that takes
        them), never killed. A second call is a no-op (False)."""
        removed = self.manager.destroy(self.layout, move_to)
        self._pids.clear()
        self._roles.clear()
        return removed

    def to_state(self) -> dict:
        """JSON-able; enough for destroy_from_state() after this process is gone."""
        return {"manager": self.manager.to_state(), "layout": self.layout.to_state()}

    @classmethod
    def from_state(cls, state: dict) -> SandboxCgroup:
        return cls(manager_from_state(state["manager"]), SandboxLayout.from_state(state["layout"]))

    @classmethod
    def destroy_from_state(cls, state: dict, move_to: str | None = None) -> bool:
        return cls.from_state(state).destroy(move_to)
