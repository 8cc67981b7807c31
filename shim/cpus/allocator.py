"""Exclusive host CPUs for pods, node-wide: every shim on the node shares one JSON file
under /run, changed only under an exclusive flock. A reservation records its shim's pid
and that process's start time, so the CPUs of a shim that died (or whose pid now names
another process) are reclaimed by the next reservation: nothing needs to clean up after
a crash. What no pod holds exclusively is the shared pool, where every other pod runs."""
from __future__ import annotations

import contextlib
import fcntl
import json
import os

from cgroups.limits import format_cpu_list, parse_cpu_list

DEFAULT_DIR = "/run/podvm/cpus"
STATE = "reservations.json"


def online_cpus() -> str:
    with open("/sys/devices/system/cpu/online") as f:
        return f.read().strip()


class NoFreeCPUs(Exception):
    """A reservation that does not fit: the message has the numbers."""


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22);
    None when it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] == b"Z":
        return None
    return int(fields[19])


class Allocator:
    def __init__(self, directory: str = DEFAULT_DIR, pool: str = "", reserved: str = "") -> None:
        """`pool`: the CPUs pods may have (default: those online); `reserved`: CPUs kept
        for the system (kubelet's reserved-cpus), never given to a pod."""
        self.directory = directory
        self.path = os.path.join(directory, STATE)
        cpus = parse_cpu_list(pool or online_cpus())
        self.pool = frozenset(cpus - parse_cpu_list(reserved))

    @contextlib.contextmanager
    def _locked(self):
        os.makedirs(self.directory, mode=0o755, exist_ok=True)
        fd = os.open(os.path.join(self.directory, "lock"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _read(self) -> dict[str, dict]:
        try:
            with open(self.path) as f:
                data = json.load(f)
        except (FileNotFoundError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def _write(self, data: dict[str, dict]) -> None:
        tmp = f"{self.path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, self.path)

    def _live(self, data: dict[str, dict]) -> dict[str, dict]:
        """Reservations whose shim still runs: the same pid and start time."""
        return {sid: r for sid, r in data.items()
                if start_time(r.get("pid", 0)) == r.get("start_time")}

    def reserve(self, sandbox_id: str, count: int, pid: int | None = None) -> frozenset[int]:
        """`count` CPUs for the sandbox, held for as long as process `pid` (default: this
        one) lives; the same set again when it already has them. NoFreeCPUs otherwise."""
        pid = pid or os.getpid()
        if count < 1:
            raise ValueError(f"an exclusive reservation needs at least 1 CPU, not {count}")
        with self._locked():
            data = self._live(self._read())
            mine = data.get(sandbox_id)
            if mine and len(mine["cpus"]) == count:
                return frozenset(mine["cpus"])
            data.pop(sandbox_id, None)
            taken = {c for r in data.values() for c in r["cpus"]}
            free = sorted(self.pool - taken)
            if len(free) < count:
                holders = ", ".join(f"{sid[:12]} ({format_cpu_list(r['cpus'])})"
                                    for sid, r in sorted(data.items()))
                raise NoFreeCPUs(
                    f"sandbox {sandbox_id} asks for {count} exclusive CPU(s) but only "
                    f"{len(free)} of the node's {len(self.pool)} ({format_cpu_list(self.pool)})"
                    f" are free; held by: {holders or 'nobody'}")
            cpus = free[:count]
            data[sandbox_id] = {"cpus": cpus, "pid": pid, "start_time": start_time(pid)}
            self._write(data)
            return frozenset(cpus)

    def release(self, sandbox_id: str) -> None:
        """Idempotent."""
        with self._locked():
            data = self._read()
            if data.pop(sandbox_id, None) is not None:
                self._write(data)

    def reservations(self) -> dict[str, frozenset[int]]:
        """The live reservations, by sandbox id."""
        with self._locked():
            return {sid: frozenset(r["cpus"]) for sid, r in self._live(self._read()).items()}

    def shared_pool(self) -> frozenset[int]:
        """The pool less every live exclusive reservation: where other pods run."""
        taken = {c for cpus in self.reservations().values() for c in cpus}
        return frozenset(self.pool - taken)

    def version(self) -> int:
        """Changes whenever a reservation is made or released (the file's mtime)."""
        try:
            return os.stat(self.path).st_mtime_ns
        except FileNotFoundError:
            return 0
