"""Real cgroups on this machine. Each test works below its own top-level cgroup
`/podvm-test-<random>` in every hierarchy, which is removed at the end even when the test
fails (tasks still there are moved to the hierarchy's root first); every process a test
starts is killed before that."""
from __future__ import annotations

import errno
import json
import os
import secrets
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Iterator

import pytest

from cgroups import CgroupManager, CgroupV1Manager, CgroupV2Manager, SandboxCgroup, SandboxLayout
from cgroups.mounts import Hierarchy, host_hierarchies
from testbed.prereqs import require, require_root, require_tool

HELPER = os.path.join(os.path.dirname(__file__), "threads_helper.py")
V1_SPLIT = {"cpu", "cpuacct", "cpuset"}
V1_WHOLE = {"memory", "pids", "devices"}


def v1_hierarchies() -> list[Hierarchy]:
    return [h for h in host_hierarchies() if h.version == 1]


def cgroup2_mount() -> str | None:
    """/sys/fs/cgroup on a v2 host, else a hybrid host's cgroup2 (e.g. .../unified)."""
    mounts = [h.mountpoint for h in host_hierarchies() if h.version == 2]
    if "/sys/fs/cgroup" in mounts:
        return "/sys/fs/cgroup"
    return mounts[0] if mounts else None


@pytest.fixture
def v1_manager() -> CgroupV1Manager:
    require_root()
    have = {c for h in v1_hierarchies() for c in h.controllers}
    require({"cpu", "memory"} <= have,
            "cgroup v1 hierarchies for cpu and memory (a v1 or hybrid host)")
    return CgroupV1Manager(v1_hierarchies())


@pytest.fixture
def v2_manager() -> CgroupV2Manager:
    require_root()
    mount = cgroup2_mount()
    require(mount is not None, "a cgroup2 mount (/sys/fs/cgroup or /sys/fs/cgroup/unified)")
    assert mount is not None
    return CgroupV2Manager(mount)


@pytest.fixture(params=["v1", "v2"])
def manager(request) -> CgroupManager:
    return request.getfixturevalue(f"{request.param}_manager")


@pytest.fixture
def test_root() -> Iterator[str]:
    """The hierarchy path every cgroup of the test lives under."""
    top = f"/podvm-test-{secrets.token_hex(4)}"
    yield top
    leftovers = []
    for h in host_hierarchies():
        if h.version == 1 and not h.controllers:
            continue
        directory = os.path.join(h.mountpoint, top.lstrip("/"))
        if os.path.isdir(directory):
            leftovers.append(directory)
            remove_tree(directory, h.mountpoint, h.version)
    for directory in leftovers:
        assert not os.path.exists(directory), f"could not remove {directory}"


def remove_tree(directory: str, mount_root: str, version: int) -> None:
    """Independent of the code under test: deepest first, tasks to the root, rmdir."""
    for dirpath, _, _ in sorted(os.walk(directory), key=lambda w: -w[0].count("/")):
        for _ in range(50):
            if version == 1:
                tids = _ids(os.path.join(dirpath, "tasks"))
                for tid in tids:
                    _try_write(os.path.join(mount_root, "tasks"), tid)
            else:
                tids = _ids(os.path.join(dirpath, "cgroup.threads"))
                for pid in {_tgid(t) for t in tids} - {None}:
                    _try_write(os.path.join(mount_root, "cgroup.procs"), pid)
            try:
                os.rmdir(dirpath)
                break
            except FileNotFoundError:
                break
            except OSError as err:
                if err.errno != errno.EBUSY:
                    raise
                time.sleep(0.05)


def _ids(path: str) -> list[int]:
    try:
        with open(path) as f:
            return [int(x) for x in f.read().split()]
    except FileNotFoundError:
        return []


def _tgid(tid: int) -> int | None:
    try:
        with open(f"/proc/{tid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("Tgid:"))
    except (FileNotFoundError, ProcessLookupError):
        return None


def _try_write(path: str, ident: int) -> None:
    try:
        with open(path, "w") as f:
            f.write(str(ident))
    except ProcessLookupError:
        pass


@pytest.fixture
def layout(test_root: str) -> SandboxLayout:
    return SandboxLayout(f"{test_root}/kubepods/burstable/pod{uuid.uuid4()}",
                         secrets.token_hex(32))


def cgroups_of(text: str) -> dict[str, str]:
    """A /proc/.../cgroup file's text, read here without the package: controller (or
    `unified`) -> path."""
    out = {}
    for line in text.splitlines():
        _, controllers, path = line.split(":", 2)
        for name in controllers.split(",") if controllers else ["unified"]:
            out[name] = path
    return out


def proc_cgroups(pid: int, tid: int) -> dict[str, str]:
    """A thread's cgroups: controller (or `unified`) -> path."""
    with open(f"/proc/{pid}/task/{tid}/cgroup") as f:
        return cgroups_of(f.read())


def expected_for(manager: CgroupManager, layout: SandboxLayout, child: str | None
                 ) -> dict[str, str]:
    """Where docs/design.md, Sandbox cgroup layout, says a thread sorted into `child` must be."""
    target = f"{layout.sandbox}/{child}" if child else layout.sandbox
    if manager.version == 2:
        return {"unified": target}
    return {**{c: target for c in V1_SPLIT & manager.controllers},
            **{c: layout.sandbox for c in V1_WHOLE & manager.controllers}}


def where(manager: CgroupManager, pid: int, tid: int) -> dict[str, str]:
    seen = proc_cgroups(pid, tid)
    keys = {"unified"} if manager.version == 2 else manager.controllers
    return {k: v for k, v in seen.items() if k in keys}


def threads_of(pid: int) -> list[int]:
    return sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))


class Processes:
    """Every process a test starts, killed (and reaped) at its end."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def add(self, proc: subprocess.Popen) -> subprocess.Popen:
        self.procs.append(proc)
        return proc

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)


@pytest.fixture
def processes(test_root: str) -> Iterator[Processes]:
    procs = Processes()
    yield procs
    procs.kill_all()


@dataclass
class Helper:
    proc: subprocess.Popen
    pid: int
    workers: list[int]

    def spawn_from(self, tid: int) -> int:
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(f"spawn {tid}\n")
        self.proc.stdin.flush()
        return int(self.proc.stdout.readline())


@pytest.fixture
def start_helper(processes: Processes) -> Callable[..., Helper]:
    """A Python process with idle threads, started inside `sandbox` when given."""

    def start(sandbox: SandboxCgroup | None = None, threads: int = 3) -> Helper:
        argv = [sys.executable, HELPER, str(threads)]
        kwargs = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        proc = processes.add(sandbox.spawn(argv, **kwargs) if sandbox
                             else subprocess.Popen(argv, **kwargs))
        assert proc.stdout is not None
        hello = json.loads(proc.stdout.readline())
        return Helper(proc=proc, pid=hello["pid"], workers=hello["threads"])

    return start


@dataclass
class Qemu:
    proc: subprocess.Popen
    qmp: object
    names: dict[int, str] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def vcpus(self) -> list[int]:
        return [c["thread-id"] for c in self.qmp.cmd("query-cpus-fast")]  # type: ignore

    def iothreads(self) -> list[int]:
        return [t["thread-id"] for t in self.qmp.cmd("query-iothreads")]  # type: ignore

    def roles(self) -> dict[str, list[int]]:
        """Every thread by role, as the shim's QEMU driver sorts them."""
        vcpus, io = self.vcpus(), self.iothreads()
        rest = [t for t in threads_of(self.pid) if t not in vcpus + io + [self.pid]]
        return {"vcpu": vcpus, "iothread": io, "main": [self.pid], "other": rest}

    def hotplug_cpu(self) -> int:
        before = set(self.vcpus())
        free = [c for c in self.qmp.cmd("query-hotpluggable-cpus")  # type: ignore
                if "qom-path" not in c][0]
        self.qmp.cmd("device_add", driver=free["type"], id=f"cpu{len(before)}",  # type: ignore
                     **free["props"])
        (new,) = set(self.vcpus()) - before
        return new


@pytest.fixture
def start_qemu(processes: Processes, tmp_path) -> Iterator[Callable[..., Qemu]]:
    """A paused TCG QEMU with 2 vCPUs (room for a third), an I/O thread and QMP."""
    qemu = require_tool("qemu-system-x86_64", "qemu-system-x86")
    from qemu.qmp import ConnectError
    from qemu.qmp.legacy import QEMUMonitorProtocol
    monitors: list[QEMUMonitorProtocol] = []

    def start(sandbox: SandboxCgroup | None = None) -> Qemu:
        sock = str(tmp_path / f"qmp{len(monitors)}.sock")
        argv = [qemu, "-S", "-nodefaults", "-display", "none", "-machine", "q35",
                "-accel", "tcg,thread=multi", "-smp", "2,maxcpus=3", "-m", "128",
                "-name", "podvm-test,debug-threads=on", "-object", "iothread,id=io0",
                "-qmp", f"unix:{sock},server=on,wait=off"]
        kwargs = dict(stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                      stderr=subprocess.PIPE)
        proc = processes.add(sandbox.spawn(argv, **kwargs) if sandbox
                             else subprocess.Popen(argv, **kwargs))
        deadline = time.monotonic() + 30
        while True:  # the socket file appears a moment before QEMU listens on it
            assert proc.poll() is None, f"QEMU exited: {proc.stderr.read()}"  # type: ignore
            if os.path.exists(sock):
                qmp = QEMUMonitorProtocol(sock)
                try:
                    qmp.connect()
                    break
                except ConnectError:
                    qmp.close()
            assert time.monotonic() < deadline, "QEMU did not answer on its QMP socket"
            time.sleep(0.02)
        monitors.append(qmp)
        return Qemu(proc=proc, qmp=qmp)

    yield start
    for qmp in monitors:
        try:
            qmp.close()
        except Exception:
            pass
