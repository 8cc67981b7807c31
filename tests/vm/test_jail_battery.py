"""What a QEMU taken over by its guest can do to the node, played as that attacker: a
process with QEMU's real powers (its uid, gid, groups and capabilities from /proc, its
mount, IPC, network and UTS namespaces by setns, no_new_privs and podvm's seccomp
filter: shim/vm/qemu/jail.py, shim/vm/qemu/pidfilter.py) tries every call of the battery the
security read found against a root process of the node (standing for containerd,
kubelet and the shims: uid 0 with every capability), another pod's QEMU, and the node
itself (PID 1, root's keyring, SysV IPC, loopback and abstract sockets, the node's
address). Every one must be refused, and the victims must live.

The control runs the same battery as QEMU ran before it had a uid and namespaces of
its own (uid 0, no capability, no_new_privs, the node's namespaces, no filter of
podvm's: the vectors that filter never covered): there the same calls reach their
targets, so the battery is real and the jail is what refuses it."""
from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import pathlib
import resource
import signal
import socket
import subprocess
import time

import psutil
import pytest
import pytest_asyncio

from shim.libc import libc
from shim.vm.agent import Agent
from shim.vm.hypervisor import VMSpec
from shim.vm.qemu import jail, pidfilter
from shim.vm.qemu.driver import QemuVM
from testbed.prereqs import require_root
from testbed.vmconfig import vm_config
from tests.vm.takeover import in_child

ON_THE_VMS = pytest.mark.asyncio(loop_scope="module")
NAMESPACES = (("ipc", jail.CLONE_NEWIPC), ("uts", jail.CLONE_NEWUTS),
              ("net", jail.CLONE_NEWNET), ("mnt", jail.CLONE_NEWNS))
SHM_KEY = 0x706F6476  # "podv"
KEY_DESCRIPTION = b"podvm-jail-battery"
KEY_SPEC_USER_KEYRING = -4
KEYCTL_UNLINK, KEYCTL_SEARCH, KEYCTL_READ = 9, 10, 11
IPC_CREAT, IPC_RMID = 0o1000, 0
SYS = {"add_key": 248, "keyctl": 250, "perf_event_open": 298, "io_uring_setup": 425}
PTRACE_SEIZE, PTRACE_DETACH = 0x4206, 17


def spec(base: pathlib.Path, name: str) -> VMSpec:
    (base / name / "shared").mkdir(parents=True, exist_ok=True)
    return VMSpec(sandbox_id=name, workdir=str(base / name / "vm"),
                  shared_dir=str(base / name / "shared"), vcpus=1, max_vcpus=1,
                  memory_mib=256, max_memory_mib=256, hypervisor=vm_config().qemu)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def vms(tmp_path_factory):
    """This pod's QEMU and another pod's, each jailed as a pod's is."""
    require_root()
    base = tmp_path_factory.mktemp("battery")
    started: list[QemuVM] = []
    try:
        for name in ("pod", "other"):
            vm = QemuVM(spec(base, name))
            started.append(vm)
            await vm.launch()
            agent = Agent.of_vm(vm)
            await agent.ping(timeout=60)
            await agent.close()
        yield started
    finally:
        for vm in started:
            await vm.stop()


# --- the attacker's side: runs in the forked child, after setns; imports nothing ---

def _call(fn) -> str:
    """"done", or the errno's name."""
    c_errno = ctypes.get_errno
    try:
        result = fn()
    except OSError as exc:
        return errno.errorcode.get(exc.errno, str(exc.errno))
    if isinstance(result, int) and result < 0:
        return errno.errorcode.get(c_errno(), str(c_errno()))
    return "done"


def _syscall(number: int, *args) -> int:
    return libc().syscall(number, *args)


def _pipe_sigio(victim: int) -> dict:
    """SIGKILL by SIGIO: a pipe's read end owned by the victim, its signal SIGKILL, then
    written to."""
    read, write = os.pipe()
    steps = {"F_SETOWN": _call(lambda: fcntl.fcntl(read, fcntl.F_SETOWN, victim)),
             "F_SETSIG": _call(lambda: fcntl.fcntl(read, pidfilter.F_SETSIG, signal.SIGKILL))}
    fcntl.fcntl(read, fcntl.F_SETFL, fcntl.fcntl(read, fcntl.F_GETFL) | os.O_ASYNC)
    os.write(write, b"x")
    return steps


def _vm_read(pid: int, address: int) -> int:
    class IoVec(ctypes.Structure):
        _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
    buf = ctypes.create_string_buffer(8)
    local, remote = IoVec(ctypes.cast(buf, ctypes.c_void_p), 8), IoVec(address, 8)
    return libc().process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)


def _perf(pid: int) -> int:
    attr = ctypes.create_string_buffer(128)  # PERF_TYPE_SOFTWARE, PERF_COUNT_SW_CPU_CLOCK
    ctypes.memmove(attr, (1).to_bytes(4, "little") + (128).to_bytes(4, "little"), 8)
    fd = _syscall(SYS["perf_event_open"], attr, pid, -1, -1, 0)
    if fd >= 0:
        os.close(fd)
    return fd


def _ptrace(pid: int) -> int:
    c = libc()
    if c.ptrace(PTRACE_SEIZE, pid, 0, 0) == 0:
        c.ptrace(PTRACE_DETACH, pid, 0, 0)
        return 0
    return -1


def _keyring() -> int:
    """Root's user keyring searched for the key the test put there, and read."""
    key = _syscall(SYS["keyctl"], KEYCTL_SEARCH, KEY_SPEC_USER_KEYRING, b"user",
                   KEY_DESCRIPTION, 0)
    if key < 0:
        return key
    buf = ctypes.create_string_buffer(64)
    return _syscall(SYS["keyctl"], KEYCTL_READ, key, buf, 64)


def _connect(family: int, address) -> None:
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.settimeout(3)
        sock.connect(address)


def battery(roots: list[int], other_qemu: int, other_address: int,
            listeners: dict) -> dict:
    """Each call of the battery; `roots`: root processes to spend, one per destructive
    call."""
    victims = iter(roots)
    tried = {
        "kill root process": _call(lambda: os.kill(next(victims), signal.SIGKILL)),
        "ptrace root process": _call(lambda: _ptrace(next(victims))),
        "prlimit64 RLIMIT_CPU=1 on root process": _call(
            lambda: resource.prlimit(next(victims), resource.RLIMIT_CPU, (1, 1))),
        "kill PID 1 (signal 0)": _call(lambda: os.kill(1, 0)),
        "kill another pod's QEMU (signal 0)": _call(lambda: os.kill(other_qemu, 0)),
        "ptrace another pod's QEMU": _call(lambda: _ptrace(other_qemu)),
        "prlimit64 read of another pod's QEMU": _call(
            lambda: resource.prlimit(other_qemu, resource.RLIMIT_NOFILE)),
        "process_vm_readv another pod's QEMU": _call(
            lambda: _vm_read(other_qemu, other_address)),
        "perf_event_open on another pod's QEMU": _call(lambda: _perf(other_qemu)),
        "perf_event_open on PID 1": _call(lambda: _perf(1)),
        "root's user keyring": _call(_keyring),
        "SysV shm of the node": _call(lambda: libc().shmget(SHM_KEY, 0, 0)),
        "io_uring_setup": _call(lambda: _io_uring()),
        "loopback listener of the node": _call(
            lambda: _connect(socket.AF_INET, ("127.0.0.1", listeners["loopback"]))),
        "abstract socket of the node": _call(
            lambda: _connect(socket.AF_UNIX, listeners["abstract"].encode("latin-1"))),
        "the node's address": _call(
            lambda: _connect(socket.AF_INET, (listeners["node"], listeners["node_port"]))),
    }
    tried["SIGKILL by F_SETOWN/F_SETSIG"] = _pipe_sigio(next(victims))
    return tried


def _io_uring() -> int:
    fd = _syscall(SYS["io_uring_setup"], 1, ctypes.create_string_buffer(120))
    if fd >= 0:
        os.close(fd)
    return fd


# --- the test's side ---

def run_as(qemu_pid: int | None, fn, *args):
    """`fn(*args)` in a forked child with QEMU `qemu_pid`'s powers, or (None) as QEMU
    was confined before its uid and namespaces: uid 0, no capability, no_new_privs, the
    node's namespaces, no filter of podvm's."""
    c = libc()  # loaded before the fork: nothing is imported after setns
    entered: list[tuple[int, int]] = []
    if qemu_pid is not None:
        fields = {k: v.strip() for k, v in (line.split(":", 1) for line in
                                            open(f"/proc/{qemu_pid}/status") if ":" in line)}
        ids = int(fields["Uid"].split()[0])
        assert int(fields["Gid"].split()[0]) == ids
        groups = tuple(int(g) for g in fields["Groups"].split())
        keep = tuple(jail.capability_names(int(fields["CapEff"], 16)))
        entered = [(os.open(f"/proc/{qemu_pid}/ns/{kind}", os.O_RDONLY), flag)
                   for kind, flag in NAMESPACES]
    else:
        ids, groups, keep = 0, (), ()

    def attacker():
        for fd, flag in entered:
            if c.setns(fd, flag) != 0:
                raise OSError(ctypes.get_errno(), f"setns {flag:#x}")
        jail.drop_privileges(keep, ids, groups)
        if qemu_pid is not None:
            pidfilter.install()
        return fn(*args)

    try:
        return in_child(attacker)
    finally:
        for fd, _ in entered:
            os.close(fd)


class Node:
    """What the battery aims at, made by the test as root in the node's namespaces."""

    def __enter__(self) -> "Node":
        c = libc()
        self.roots = [subprocess.Popen(["sleep", "600"]) for _ in range(4)]
        key = c.syscall(SYS["add_key"], b"user", KEY_DESCRIPTION, b"node-secret", 11,
                        KEY_SPEC_USER_KEYRING)
        assert key > 0, ctypes.get_errno()
        self.key = key
        self.shm = c.shmget(SHM_KEY, 4096, IPC_CREAT | 0o600)
        assert self.shm >= 0, ctypes.get_errno()
        self.sockets = []
        loopback = self._listen(socket.AF_INET, ("127.0.0.1", 0))
        abstract_name = f"\0podvm-jail-battery-{os.getpid()}"
        self._listen(socket.AF_UNIX, abstract_name.encode("latin-1"))
        address = node_address()
        node = self._listen(socket.AF_INET, (address, 0))
        self.listeners = {"loopback": loopback.getsockname()[1], "abstract": abstract_name,
                          "node": address, "node_port": node.getsockname()[1]}
        return self

    def _listen(self, family: int, address) -> socket.socket:
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.bind(address)
        sock.listen(8)
        self.sockets.append(sock)
        return sock

    def alive(self) -> list[bool]:
        time.sleep(0.3)  # a signal sent is delivered by now
        return [p.poll() is None for p in self.roots]

    def fresh(self) -> None:
        """Victims spent by the control replaced."""
        self.roots = [p if p.poll() is None else subprocess.Popen(["sleep", "600"])
                      for p in self.roots]

    def __exit__(self, *_) -> None:
        c = libc()
        for p in self.roots:
            p.kill()
            p.wait()
        c.syscall(SYS["keyctl"], KEYCTL_UNLINK, self.key, KEY_SPEC_USER_KEYRING)
        c.shmctl(self.shm, IPC_RMID, None)
        for sock in self.sockets:
            sock.close()


def node_address() -> str:
    """An IPv4 address of the node other than loopback (every CI machine has one)."""
    for name, addresses in psutil.net_if_addrs().items():
        for a in addresses:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return a.address
    raise AssertionError("the node has no IPv4 address but loopback")


def mapped_address(pid: int) -> int:
    with open(f"/proc/{pid}/maps") as f:
        return int(f.readline().split("-", 1)[0], 16)


REACHED_BEFORE = {
    "kill root process", "prlimit64 RLIMIT_CPU=1 on root process", "kill PID 1 (signal 0)",
    "root's user keyring", "SysV shm of the node", "loopback listener of the node",
    "abstract socket of the node", "the node's address"}
"""What QEMU as it was confined before reaches with no bug of the kernel's (the control):
its uid was every root process's, and it shared the node's IPC and network namespaces.
io_uring and perf_event_open depend on the node's sysctls, so they are not counted; nor
is another pod's QEMU, which now runs as a uid of its own whatever the control is."""


@ON_THE_VMS
async def test_an_attacker_with_qemu_s_powers_is_refused_every_call(vms) -> None:
    this, other = vms
    assert this.jail_id != other.jail_id and 0 not in (this.jail_id, other.jail_id)
    assert jail.confinement(this.pid)["own_namespaces"] == ["mnt", "net", "ipc", "uts"]
    with Node() as node:
        tried = run_as(this.pid, battery, [p.pid for p in node.roots], other.pid,
                       mapped_address(other.pid), node.listeners)
        assert node.alive() == [True] * len(node.roots), tried
        sigio = tried.pop("SIGKILL by F_SETOWN/F_SETSIG")
        assert sigio == {"F_SETOWN": "EPERM", "F_SETSIG": "EPERM"}
        refused = {"EPERM", "EACCES", "ESRCH", "ENOENT", "ENOKEY", "ECONNREFUSED",
                   "ENETUNREACH"}
        assert {k: v for k, v in tried.items() if v not in refused} == {}, tried
        # each refused for the reason the jail gives, not by chance
        assert tried["SysV shm of the node"] == "ENOENT"  # another IPC namespace
        assert tried["loopback listener of the node"] == "ECONNREFUSED"  # QEMU's own lo
        assert tried["abstract socket of the node"] == "ECONNREFUSED"
        assert tried["the node's address"] == "ENETUNREACH"  # no route out
        assert other.dead() is False and this.dead() is False


@ON_THE_VMS
async def test_the_control_reaches_the_node_as_qemu_did_before_its_jail_had_a_uid(
        vms) -> None:
    _, other = vms
    with Node() as node:
        tried = run_as(None, battery, [p.pid for p in node.roots], other.pid,
                       mapped_address(other.pid), node.listeners)
        alive = node.alive()
        node.fresh()
    sigio = tried.pop("SIGKILL by F_SETOWN/F_SETSIG")
    assert sigio == {"F_SETOWN": "done", "F_SETSIG": "done"} and alive[-1] is False
    assert alive[0] is False  # `kill root process`
    assert {k for k, v in tried.items() if v == "done"} >= REACHED_BEFORE, tried


@ON_THE_VMS
async def test_the_uid_alone_refuses_the_cross_process_calls(vms) -> None:
    """Without the filter (QEMU's uid and namespaces only), the kernel's own checks
    refuse what crosses to another uid: the filter is the second wall."""
    this, other = vms

    with Node() as node:
        original = pidfilter.install
        pidfilter.install = lambda: None  # in the forked child only the copy matters
        try:
            tried = run_as(this.pid, battery, [p.pid for p in node.roots], other.pid,
                           mapped_address(other.pid), node.listeners)
        finally:
            pidfilter.install = original
        assert node.alive() == [True] * len(node.roots), tried
    for call in ("kill root process", "ptrace root process",
                 "prlimit64 RLIMIT_CPU=1 on root process", "kill PID 1 (signal 0)",
                 "kill another pod's QEMU (signal 0)", "ptrace another pod's QEMU",
                 "prlimit64 read of another pod's QEMU",
                 "process_vm_readv another pod's QEMU"):
        assert tried[call] in ("EPERM", "EACCES"), (call, tried[call])
