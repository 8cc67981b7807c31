"""What the node monitor reads of each sandbox at scrape time: the state its shim keeps
(shim/host/podstate.py's sandbox.json, shim/host/shimstate.py's shim.json), the sandbox
cgroup's memory charge and OOM kills, and the host CPU time charged to the pod by thread
role (podvmctl/status.py's thread_role). Never a shim: a scrape must not wait on
one, and a dead one still has state to show. A sandbox that disappears, or whose files
cannot be read whole, mid-scrape is left out of that scrape, never an error."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Iterator

import cgroups

from podvmctl.status import thread_role
from shim.host import paths
from shim.host.podstate import STATE_FILE, PodState, PodStateError
from shim.host.shimstate import SHIM_STATE

TICKS = os.sysconf("SC_CLK_TCK")
"""/proc's utime and stime are in clock ticks."""


@dataclass(frozen=True)
class Sandbox:
    namespace: str
    """containerd's namespace."""
    state: PodState
    running: bool
    """Its QEMU is the process the state names (not one that exited or a later pid's)."""
    memory_bytes: int | None = None
    """What the sandbox cgroup is charged now; None where unreadable."""
    host_oom_kills: int | None = None
    """The sandbox cgroup's OOM kills (the host killing the VM's processes)."""
    cpu_seconds: dict[str, float] = field(default_factory=dict)
    """CPU time charged to the sandbox cgroup, by role: vcpu from the vcpus/ cgroup's
    counter, the others summed over the threads alive now (a role whose thread exited
    loses its time: Prometheus reads that as a counter reset)."""


@dataclass(frozen=True)
class _Known:
    identity: tuple[int, int, int]
    """sandbox.json's inode, mtime and size when read."""
    state: PodState
    shim_pid: int


@dataclass
class _CgroupRead:
    memory: int | None
    ooms: int | None
    tids: list[int]
    """Threads in the sandbox cgroup and vmm/ (the cpu hierarchy's), vcpus/ not."""
    vcpu_seconds: float | None


class Reader:
    """Reads every sandbox under `root`; keeps the cgroup managers it rebuilt from the
    states (one per host layout, so one on a node) between scrapes. `host_root`: where
    the host's / is (a container that mounts it elsewhere): the cgroup mount points the
    states name and /proc are read under it."""

    def __init__(self, root: str = paths.STATE_ROOT, host_root: str = "/") -> None:
        self.root = root
        self.host_root = host_root
        self.proc = rooted(host_root, "/proc")
        self._managers: dict[str, cgroups.CgroupManager] = {}
        self._known: dict[str, _Known] = {}
        """By state directory: what was read of it, while its sandbox.json is unchanged."""

    def sandboxes(self) -> Iterator[Sandbox]:
        seen: set[str] = set()
        for namespace in _listdir(self.root):
            for sandbox_id in _listdir(os.path.join(self.root, namespace)):
                state_dir = os.path.join(self.root, namespace, sandbox_id)
                seen.add(state_dir)
                found = self.read(state_dir)
                if found is not None:
                    yield found
        for gone in self._known.keys() - seen:
            self._known.pop(gone, None)

    def read(self, state_dir: str) -> Sandbox | None:
        """None where there is no whole sandbox.json (not a sandbox, or one going away)."""
        known = self._state(state_dir)
        if known is None:
            return None
        state = known.state
        namespace = os.path.basename(os.path.dirname(state_dir))
        try:
            found = self._cgroup(self._manager(state), state)
        except (OSError, cgroups.CgroupError, ValueError):
            return Sandbox(namespace, state, running=False)
        cpu, running = self._threads(state, found.tids, known.shim_pid)
        if found.vcpu_seconds is not None:
            cpu["vcpu"] = cpu.get("vcpu", 0.0) + found.vcpu_seconds
        return Sandbox(namespace, state, running, found.memory, found.ooms, cpu)

    def _state(self, state_dir: str) -> _Known | None:
        """Read again only when sandbox.json changed: the shim replaces it whole on every
        change (a new inode), so an unchanged identity is an unchanged state. shim.json
        is written once, before it."""
        path = os.path.join(state_dir, STATE_FILE)
        try:
            st = os.stat(path)
            identity = (st.st_ino, st.st_mtime_ns, st.st_size)
            known = self._known.get(state_dir)
            if known is not None and known.identity == identity:
                return known
            known = _Known(identity, PodState.load(path), _shim_pid(state_dir))
        except (OSError, PodStateError):
            self._known.pop(state_dir, None)
            return None
        self._known[state_dir] = known
        return known

    def _manager(self, state: PodState) -> cgroups.CgroupManager:
        """The host's hierarchies as the state describes them, their mount points under
        the host root; rebuilt once per description (one on a node)."""
        key = json.dumps(dict(state.cgroup.manager), sort_keys=True)
        manager = self._managers.get(key)
        if manager is None:
            described = json.loads(key)
            for place in described.get("hierarchies", [described]):
                place["mountpoint"] = rooted(self.host_root, place["mountpoint"])
            manager = self._managers[key] = cgroups.manager_from_state(described)
        return manager

    def _cgroup(self, manager: cgroups.CgroupManager, state: PodState) -> _CgroupRead:
        """The vCPUs' CPU time from their cgroup's own counter (one file however many
        vCPUs, and it keeps the time of threads that exited), the other threads one by
        one (their roles share the vmm/ cgroup)."""
        layout = state.cgroup.layout
        if isinstance(manager, cgroups.CgroupV2Manager):
            d = manager.hierarchy.directory(layout.sandbox)
            usec = _keyed(f"{manager.hierarchy.directory(layout.vcpus)}/cpu.stat",
                          "usage_usec")
            return _CgroupRead(
                _number(f"{d}/memory.current"), _keyed(f"{d}/memory.events", "oom_kill"),
                [t for p in (layout.sandbox, layout.vmm)
                 for t in _ids(f"{manager.hierarchy.directory(p)}/cgroup.threads")],
                usec / 1e6 if usec is not None else None)
        assert isinstance(manager, cgroups.CgroupV1Manager)
        found = _CgroupRead(None, None, [], None)
        for h in manager.hierarchies:
            if "memory" in h.controllers:
                d = h.directory(layout.sandbox)
                found.memory = _number(f"{d}/memory.usage_in_bytes")
                found.ooms = _keyed(f"{d}/memory.oom_control", "oom_kill")
            if "cpu" in h.controllers:
                found.tids = [t for p in (layout.sandbox, layout.vmm)
                              for t in _ids(f"{h.directory(p)}/tasks")]
            if "cpuacct" in h.controllers:
                nsec = _number(f"{h.directory(layout.vcpus)}/cpuacct.usage")
                found.vcpu_seconds = nsec / 1e9 if nsec is not None else None
        return found

    def _threads(self, state: PodState, tids: list[int], shim_pid: int
                 ) -> tuple[dict[str, float], bool]:
        """CPU seconds by role, and whether the recorded QEMU is the one running."""
        cpu: dict[str, float] = {}
        running = False
        for tid in tids:
            stat = _read(f"{self.proc}/{tid}/stat")
            if not stat:
                continue  # exited since the cgroup was read
            name, fields = _stat_fields(stat)
            if tid == state.qemu_pid:
                running = state.qemu_start_time in (None, int(fields[19]))
            role = "shim" if tid == shim_pid else \
                thread_role(state.qemu_pid, tid, name, shim_pid)
            cpu[role] = cpu.get(role, 0.0) + (int(fields[11]) + int(fields[12])) / TICKS
        return cpu, running


def rooted(host_root: str, path: str) -> str:
    """The host's `path` as seen from here."""
    return os.path.join(host_root, path.lstrip("/"))


def _shim_pid(state_dir: str) -> int:
    text = _read(os.path.join(state_dir, SHIM_STATE))
    try:
        pid = json.loads(text).get("pid") if text else 0
    except (ValueError, AttributeError):
        return 0
    return pid if isinstance(pid, int) else 0


def _stat_fields(stat: str) -> tuple[str, list[str]]:
    """The thread's name and the fields after it (the name may hold spaces and ')')."""
    close = stat.rindex(")")
    return stat[stat.index("(") + 1:close], stat[close + 2:].split()


def _listdir(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def _read(path: str) -> str:
    """The file's text, "" when it is gone or unreadable (os.open: a scrape reads
    thousands of small files, and the io stack costs more than the read)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return ""
    try:
        return os.read(fd, 65536).decode(errors="replace")
    except OSError:
        return ""
    finally:
        os.close(fd)


def _number(path: str) -> int | None:
    text = _read(path).strip()
    return int(text) if text.isdigit() else None


def _keyed(path: str, key: str) -> int | None:
    """`key`'s value in a flat-keyed cgroup file (memory.events, memory.oom_control)."""
    for line in _read(path).splitlines():
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return None


def _ids(path: str) -> list[int]:
    return [int(line) for line in _read(path).split() if line.isdigit()]
