"""Exclusive host CPUs for pods, node-wide (cpu_reservation = "exclusive", docs/design.md,
CPUs): every shim on the node shares one JSON file under /run, changed only under
an exclusive flock and replaced atomically (write a temporary file, rename it), so a
reader never sees half a state and a crash mid-write loses nothing.

A reservation records its shim's pid and that process's start time. The CPUs of a shim
that died, or whose pid now names another process, are reclaimed by the next reservation
and never counted as held by any reader: nothing needs to clean up after a crash. What no
pod holds exclusively is the shared pool, where every other pod runs."""
from __future__ import annotations

import contextlib
import fcntl
import glob
import json
import os
from typing import Iterable, Iterator, Mapping

from podvm_core.atomic import write_json

from ..host.processes import start_time
from .cpuset import SYS_CPU, core_siblings, format_cpu_list, online_cpus, parse_cpu_list

DEFAULT_DIR = "/run/podvm/cpus"
STATE = "reservations.json"
LOCK = "lock"

Entries = dict[str, dict]


class AllocatorError(Exception):
    """The allocator cannot answer safely; the message says where and why."""


class NoFreeCPUs(AllocatorError):
    """A reservation that does not fit: the message has the numbers and the holders."""


def choose(free: Iterable[int], count: int,
           siblings: Mapping[int, frozenset[int]]) -> list[int]:
    """`count` of the `free` CPUs (the caller checked there are enough). Whole free cores
    first, so that no neighbour runs on the SMT sibling of a CPU promised to a pod; the
    remainder from cores already partly taken first, to keep whole cores whole for the
    next pod; highest CPUs first, because CPU 0 does most of the node's housekeeping and
    interrupts and should stay in the shared pool longest."""
    free = set(free)
    if count > len(free):
        raise ValueError(f"{count} CPUs asked from {len(free)} free")
    core = {c: siblings.get(c, frozenset({c})) | {c} for c in free}
    chosen: list[int] = []
    whole = sorted({core[c] for c in free if core[c] <= free}, key=max, reverse=True)
    for cpus in whole:
        if len(cpus) <= count - len(chosen):
            chosen += sorted(cpus, reverse=True)
    left = free - set(chosen)
    chosen += sorted(left, key=lambda c: (core[c] <= free, -c))[:count - len(chosen)]
    return chosen


class Allocator:
    """The node's exclusive CPUs. Every method re-reads the file: other shims change it."""

    def __init__(self, directory: str = DEFAULT_DIR, pool: str = "", reserved: str = "",
                 sys_cpu: str = SYS_CPU) -> None:
        """`pool`: the CPUs pods may have (default: those online); `reserved`: CPUs kept
        for the system (kubelet's --reserved-cpus), never given to a pod."""
        self.directory = directory
        self.path = os.path.join(directory, STATE)
        cpus = parse_cpu_list(pool, "CPU pool") if pool else online_cpus(sys_cpu)
        self.reserved = parse_cpu_list(reserved, "reserved CPUs")
        self.pool = frozenset(cpus - self.reserved)
        if not self.pool:
            raise AllocatorError(f"no CPU is left for pods: the pool {format_cpu_list(cpus)} "
                                 f"less the reserved {format_cpu_list(self.reserved)}")
        self.siblings = core_siblings(self.pool, sys_cpu)

    def reserve(self, sandbox_id: str, count: int,
                owner_pid: int | None = None) -> frozenset[int]:
        """`count` CPUs for the sandbox, held for as long as process `owner_pid` (default:
        this one) lives. Asked again, it keeps the CPUs it has (a larger count adds to
        them, a smaller one gives the lowest back). NoFreeCPUs when they do not fit."""
        owner_pid = owner_pid or os.getpid()
        if count < 1:
            raise ValueError(f"an exclusive reservation needs at least 1 CPU, not {count}")
        born = start_time(owner_pid)
        if born is None:
            raise ValueError(f"sandbox {sandbox_id}: owner process {owner_pid} is not running")
        with self._locked():
            entries = self._load()
            live = self._live(entries)
            reclaimed = len(live) != len(entries)
            others = {sid: e for sid, e in live.items() if sid != sandbox_id}
            mine = frozenset(live[sandbox_id]["cpus"]) if sandbox_id in live else frozenset()
            taken = frozenset(c for e in others.values() for c in e["cpus"])
            keep = sorted(mine & self.pool, reverse=True)[:count]
            free = self.pool - taken - mine
            if count - len(keep) > len(free):
                if reclaimed:
                    self._save(live)
                raise NoFreeCPUs(self._refusal(sandbox_id, count, len(free) + len(keep),
                                               others))
            cpus = sorted(keep + choose(free, count - len(keep), self.siblings))
            live[sandbox_id] = {"cpus": cpus, "pid": owner_pid, "start_time": born}
            if reclaimed or live[sandbox_id] != entries.get(sandbox_id):
                self._save(live)
            return frozenset(cpus)

    def release(self, sandbox_id: str) -> frozenset[int]:
        """The sandbox's CPUs back to the shared pool; those it held (none: nothing to do,
        so releasing twice is harmless)."""
        with self._locked():
            entries = self._load()
            entry = entries.pop(sandbox_id, None)
            if entry is not None:
                self._save(self._live(entries))
            return frozenset(entry["cpus"]) if entry else frozenset()

    def reservations(self) -> dict[str, frozenset[int]]:
        """The live reservations, by sandbox id. Read without the lock: the file is only
        ever replaced whole."""
        return {sid: frozenset(e["cpus"]) for sid, e in self._live(self._load()).items()}

    def shared_pool(self) -> frozenset[int]:
        """The pool less every live exclusive reservation: where the other pods run."""
        taken = {c for cpus in self.reservations().values() for c in cpus}
        return frozenset(self.pool - taken)

    def version(self) -> int:
        """Changes whenever the live reservations do, a holder's death included: pods in
        the shared pool poll it to follow the pool."""
        return hash(tuple(sorted((sid, tuple(sorted(cpus)))
                                 for sid, cpus in self.reservations().items())))

    def _refusal(self, sandbox_id: str, count: int, free: int, live: Entries) -> str:
        holders = ", ".join(f"{sid[:12]} ({format_cpu_list(e['cpus'])})"
                            for sid, e in sorted(live.items()))
        system = (f"; {format_cpu_list(self.reserved)} reserved for the system"
                  if self.reserved else "")
        return (f"sandbox {sandbox_id} asks for {count} exclusive CPU(s) but only {free} of "
                f"the node's {len(self.pool)} ({format_cpu_list(self.pool)}) are free; "
                f"held by: {holders or 'nobody'}{system}")

    @staticmethod
    def _live(entries: Entries) -> Entries:
        """Reservations whose owner still runs: the same pid with the same start time."""
        return {sid: e for sid, e in entries.items()
                if start_time(e["pid"]) == e["start_time"]}

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """The lock is a file of its own: the state file is replaced on every change, so
        a lock on it would be a lock on a file nobody opens next."""
        os.makedirs(self.directory, mode=0o755, exist_ok=True)
        fd = os.open(os.path.join(self.directory, LOCK), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _load(self) -> Entries:
        """The file's entries. A file that cannot be read refuses every answer rather than
        reading as empty: that would give CPUs already held to a second pod."""
        try:
            with open(self.path) as f:
                data = json.load(f)
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            raise AllocatorError(f"{self.path}: unreadable ({exc}); remove it only when no "
                                 f"podvm pod holds exclusive CPUs") from None
        if not isinstance(data, dict) or not all(_valid(e) for e in data.values()):
            raise AllocatorError(f"{self.path}: not podvm's reservations; remove it only when "
                                 f"no podvm pod holds exclusive CPUs")
        return data

    def _save(self, entries: Entries) -> None:
        tmp = f"{self.path}.{os.getpid()}.tmp"
        for stale in glob.glob(f"{glob.escape(self.path)}.*.tmp"):  # of writers that died
            if stale != tmp:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(stale)
        write_json(self.path, entries, durable=True, indent=1, sort_keys=True)


def _valid(entry: object) -> bool:
    return (isinstance(entry, dict) and isinstance(entry.get("pid"), int)
            and isinstance(entry.get("start_time"), int)
            and isinstance(entry.get("cpus"), list)
            and all(isinstance(c, int) for c in entry["cpus"]))
