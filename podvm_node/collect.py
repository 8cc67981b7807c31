"""What the node monitor reads of each sandbox at scrape time: the state its shim keeps
(shim/host/podstate.py's sandbox.json, shim/host/shimstate.py's shim.json), the sandbox
cgroup's memory charge and OOM kills, and the host CPU time charged to the pod by thread
role (podvmctl/status.py's thread_role). Never a shim: a scrape must not wait on
one, and a dead one still has state to show. A sandbox that disappears, or whose files
cannot be read whole, mid-scrape is left out of that scrape, never an error.

A scrape reads a thousand small files, so what cannot change while a sandbox.json is
unchanged is worked out once per state (where its cgroup files are, which thread has which
role, whether its QEMU is the process the state names), and the files read at every
scrape are kept open (_Open)."""
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
class _Files:
    """The cgroup files a scrape reads of one sandbox (None: no hierarchy has it)."""
    memory: str | None
    events: str | None
    """memory.events (v2) or memory.oom_control (v1): `oom_kill` is the count."""
    vcpu_counter: str | None
    vcpu_key: str | None
    """The counter's key in a flat-keyed file (v2's cpu.stat), None for a bare number."""
    vcpu_scale: float
    """The counter's units per second."""
    threads: tuple[str, ...]
    """The thread lists of the sandbox cgroup and vmm/ (the cpu hierarchy's)."""
    threads_held: bool
    """Whether a thread list may be kept open (_Open): cgroup v2 writes it anew at each
    read from 0, v1 serves the list it made at open for a second after."""


class _Open:
    """Files read at every scrape, kept open and read from offset 0: /proc and cgroupfs
    write a file's text anew at each read from 0, and opening and closing one cost more
    than reading it."""

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}

    def read(self, path: str) -> str:
        """"" where the file is gone (its cgroup removed, its thread exited: a thread id
        that comes again is another thread's, opened anew)."""
        fd = self._fds.get(path)
        if fd is None:
            try:
                fd = self._fds[path] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                return ""
        try:
            return os.pread(fd, 65536, 0).decode(errors="replace")
        except OSError:  # ENODEV, ESRCH
            os.close(self._fds.pop(path))
            return ""

    def keep(self, paths: set[str]) -> None:
        """Closes the files not in `paths`."""
        for path in self._fds.keys() - paths:
            os.close(self._fds.pop(path))

    def close(self) -> None:
        self.keep(set())


@dataclass
class _Known:
    identity: tuple[int, int, int]
    """sandbox.json's inode, mtime and size when read."""
    state: PodState
    shim_pid: int
    files: _Files | None = None
    roles: dict[int, str] = field(default_factory=dict)
    """By thread id, the threads read last scrape: a thread's name is set when QEMU or
    virtiofsd starts it, and a new state comes with a new _Known."""
    qemu_verified: bool | None = None
    """Whether the state's QEMU pid has the state's start time (None: not yet seen)."""
    counters: _Open = field(default_factory=_Open)
    """The cgroup's memory, OOM and vCPU time files (and on v2 its thread lists)."""
    threads: _Open = field(default_factory=_Open)
    """Each thread's schedstat."""

    def close(self) -> None:
        self.counters.close()
        self.threads.close()


@dataclass
class _CgroupRead:
    memory: int | None
    ooms: int | None
    tids: list[int]
    """Threads in the sandbox cgroup and vmm/ (the cpu hierarchy's), vcpus/ not."""
    vcpu_seconds: float | None


class Reader:
    """Reads every sandbox under `root`, one scrape at a time; keeps the cgroup managers
    it rebuilt from the states (one per host layout, so one on a node) between scrapes,
    and the files it reads at every scrape open (five a sandbox and one a thread, about
    a dozen: close() closes them).
    `host_root`: where the host's / is (a container that mounts it elsewhere): the cgroup
    mount points the states name and /proc are read under it."""

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
            self._forget(gone)

    def close(self) -> None:
        for state_dir in list(self._known):
            self._forget(state_dir)

    def _forget(self, state_dir: str) -> None:
        known = self._known.pop(state_dir, None)
        if known is not None:
            known.close()

    def read(self, state_dir: str) -> Sandbox | None:
        """None where there is no whole sandbox.json (not a sandbox, or one going away)."""
        known = self._state(state_dir)
        if known is None:
            return None
        state = known.state
        namespace = os.path.basename(os.path.dirname(state_dir))
        try:
            if known.files is None:
                known.files = _files(self._manager(state), state.cgroup.layout)
        except (OSError, cgroups.CgroupError, ValueError):
            return Sandbox(namespace, state, running=False)
        found = _cgroup(known.files, known.counters)
        cpu, running = self._threads(known, found.tids)
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
            self._forget(state_dir)
            return None
        self._forget(state_dir)
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

    def _threads(self, known: _Known, tids: list[int]) -> tuple[dict[str, float], bool]:
        """CPU seconds by role, each thread's from its schedstat (the scheduler's run time
        in ns, the unit of the vcpus/ counter; /proc/<tid>/stat would give the whole
        process's ticks), and whether the recorded QEMU is the one running."""
        cpu: dict[str, float] = {}
        roles: dict[int, str] = {}
        read: set[str] = set()
        for tid in tids:
            path = f"{self.proc}/{tid}/task/{tid}/schedstat"
            ran = known.threads.read(path).split(" ", 1)[0]
            role = (known.roles.get(tid) or self._role(known, tid)) if ran else None
            if role is None or not ran.isdigit() or tid in roles:
                continue  # exited since the cgroup was read
            roles[tid] = role
            read.add(path)
            cpu[role] = cpu.get(role, 0.0) + int(ran) / 1e9
        known.roles = roles
        known.threads.keep(read)
        return cpu, known.state.qemu_pid in roles and self._qemu_verified(known)

    def _role(self, known: _Known, tid: int) -> str | None:
        name = _read(f"{self.proc}/{tid}/task/{tid}/comm").rstrip("\n")
        if not name:
            return None
        if tid == known.shim_pid:
            return "shim"
        return thread_role(known.state.qemu_pid, tid, name, known.shim_pid)

    def _qemu_verified(self, known: _Known) -> bool:
        """The QEMU pid in the cgroup has the start time the state recorded (a pid can
        be a later process's); checked once per state."""
        if known.qemu_verified is None:
            stat = _read(f"{self.proc}/{known.state.qemu_pid}/stat")
            if not stat:
                return False
            started = int(_stat_fields(stat)[1][19])
            known.qemu_verified = known.state.qemu_start_time in (None, started)
        return known.qemu_verified


def _files(manager: cgroups.CgroupManager, layout: cgroups.SandboxLayout) -> _Files:
    """The vCPUs' CPU time comes from their cgroup's own counter (one file however many
    vCPUs, and it keeps the time of threads that exited), the other threads' one by one
    (their roles share the vmm/ cgroup)."""
    if isinstance(manager, cgroups.CgroupV2Manager):
        d = manager.hierarchy.directory
        return _Files(f"{d(layout.sandbox)}/memory.current",
                      f"{d(layout.sandbox)}/memory.events", f"{d(layout.vcpus)}/cpu.stat",
                      "usage_usec", 1e6, tuple(f"{d(p)}/cgroup.threads"
                                               for p in (layout.sandbox, layout.vmm)), True)
    assert isinstance(manager, cgroups.CgroupV1Manager)
    memory = events = vcpus = None
    threads: tuple[str, ...] = ()
    for h in manager.hierarchies:
        if "memory" in h.controllers:
            memory = f"{h.directory(layout.sandbox)}/memory.usage_in_bytes"
            events = f"{h.directory(layout.sandbox)}/memory.oom_control"
        if "cpu" in h.controllers:
            threads = tuple(f"{h.directory(p)}/tasks" for p in (layout.sandbox, layout.vmm))
        if "cpuacct" in h.controllers:
            vcpus = f"{h.directory(layout.vcpus)}/cpuacct.usage"
    return _Files(memory, events, vcpus, None, 1e9, threads, False)


def _cgroup(files: _Files, counters: _Open) -> _CgroupRead:
    vcpus = counters.read(files.vcpu_counter) if files.vcpu_counter else ""
    counter = _keyed(vcpus, files.vcpu_key) if files.vcpu_key else _number(vcpus)
    return _CgroupRead(
        _number(counters.read(files.memory)) if files.memory else None,
        _keyed(counters.read(files.events), "oom_kill") if files.events else None,
        [t for path in files.threads
         for t in _ids(counters.read(path) if files.threads_held else _read(path))],
        counter / files.vcpu_scale if counter is not None else None)


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


def _number(text: str) -> int | None:
    text = text.strip()
    return int(text) if text.isdigit() else None


def _keyed(text: str, key: str) -> int | None:
    """`key`'s value in a flat-keyed cgroup file (memory.events, memory.oom_control)."""
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return None


def _ids(text: str) -> list[int]:
    return [int(line) for line in text.split() if line.isdigit()]
