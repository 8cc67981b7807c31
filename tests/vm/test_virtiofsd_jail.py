"""A guest that took over the pod's virtiofsd, played with the daemon's real powers
(tests/vm/takeover.py: its uid, gids and capabilities, every namespace it is in, its
root, a copy of each descriptor it holds, its seccomp filter copied from the kernel):
the daemon as podvm starts it (shim/vm/virtiofsd.py) reaches the pod's files and nothing
else: not the host's /proc/sys (core_pattern, modprobe: root on the node), its
sysrq-trigger, its /etc, another pod's files, a loopback listener or an abstract unix
socket of the host, the host's SysV shared memory, the host's hostname. Past its filter
too, where the namespaces and its credentials alone must hold. QEMU 7.2's C daemon,
which runs only under allow_legacy_virtiofsd, reaches core_pattern: why it needs that
key, and the proof that these attempts find a way out where there is one.

The daemon is served to a bare vhost-user connection rather than to a QEMU: it is
confined before it reads the front end's first message (the C one once connected), and
all a QEMU adds to it are the guest's RAM and the rings' eventfds."""
from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import pathlib
import socket
from typing import AsyncIterator

import pytest

from shim.vm import virtiofsd
from shim.vm.hypervisor import HypervisorError
from testbed.vmconfig import QEMU_VIRTIOFSD, rust_virtiofsd, virtiofs_daemon
from tests.vm import takeover
from tests.vm.takeover import Held, in_proc, open_from_anywhere, same_file
from tests.vm.test_qemu import spec

IPC_PRIVATE, IPC_CREAT, IPC_RMID, SHM_RDONLY = 0, 0o1000, 0, 0o10000
PROC_TARGETS = ("/proc/sys/kernel/core_pattern", "/proc/sys/kernel/modprobe",
                "/proc/sysrq-trigger")
"""Each written by root is root on the node (a core dump or a module load runs a program
of the writer's choosing; sysrq crashes or reboots it). Only opened for writing, never
written: the open is where the kernel says yes or no."""


def _libc() -> ctypes.CDLL:
    c = ctypes.CDLL(None, use_errno=True)
    c.shmat.restype = ctypes.c_void_p
    c.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    c.shmdt.argtypes = [ctypes.c_void_p]
    c.sethostname.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    return c


@contextlib.asynccontextmanager
async def serving(tmp_path: pathlib.Path, **qemu: object) -> AsyncIterator[int]:
    """The pod's virtiofsd as podvm starts it, connected to: the pid of the process that
    serves (the child its sandbox made), gone afterwards."""
    s = spec(tmp_path, **qemu)
    os.makedirs(s.workdir, exist_ok=True)
    server = virtiofsd.FileServer(s)
    await server.start(None)
    front = socket.socket(socket.AF_UNIX)
    try:
        front.connect(os.path.join(s.workdir, "virtiofs.sock"))
        for _ in range(500):
            jailed = [p for p in server.pids() if _status(p).get("Seccomp") == "2"]
            if jailed:
                break
            await asyncio.sleep(0.01)
        assert jailed, f"virtiofsd never entered its sandbox: {server.said()}"
        yield jailed[0]
    finally:
        front.close()
        await server.stop()


def _status(pid: int) -> dict[str, str]:
    try:
        text = pathlib.Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    return {k: v.strip() for k, v in (line.split(":", 1) for line in text.splitlines())}


@contextlib.contextmanager
def host_targets(tmp_path: pathlib.Path):
    """What a takeover must not reach, made in the host's namespaces: another pod's file,
    a loopback listener, an abstract unix socket, a SysV shared memory segment of root's
    (mode 0600); and the pod's own file, which it must."""
    c = _libc()
    own = tmp_path / "shared" / "own-file"
    own.parent.mkdir(exist_ok=True)
    own.write_text("the pod's")
    other = tmp_path / "other-pod" / "shared" / "secret"
    other.parent.mkdir(parents=True)
    other.write_text("another pod's")
    listener = socket.create_server(("127.0.0.1", 0))
    abstract = socket.socket(socket.AF_UNIX)
    abstract.bind(f"\0podvm-takeover-{os.getpid()}")
    abstract.listen()
    shm = c.shmget(IPC_PRIVATE, 4096, IPC_CREAT | 0o600)
    assert shm >= 0, os.strerror(ctypes.get_errno())
    hostname = socket.gethostname()
    try:
        yield {"own": own, "other": other, "port": listener.getsockname()[1],
               "abstract": abstract.getsockname(), "shm": shm, "hostname": hostname}
    finally:
        if socket.gethostname() != hostname:  # a takeover got there: put it back
            c.sethostname(hostname.encode(), len(hostname.encode()))
        c.shmctl(shm, IPC_RMID, None)
        listener.close()
        abstract.close()


def attempts(targets: dict) -> dict[str, takeover.Attempt]:
    c = _libc()

    def stat_of(path: str | pathlib.Path) -> tuple[int, int]:
        st = os.stat(path)
        return st.st_dev, st.st_ino

    def connect(family: int, address: object) -> str:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.connect(address)
        return f"reached {address!r}"

    def shm(_: Held) -> str:
        at = c.shmat(targets["shm"], None, SHM_RDONLY)
        if at is None or at == ctypes.c_void_p(-1).value:
            return f"refused: shmat: {os.strerror(ctypes.get_errno())}"
        c.shmdt(at)
        return f"reached the host's segment {targets['shm']}"

    def hostname(_: Held) -> str:
        if c.sethostname(b"podvm-takeover", 14) != 0:
            return f"refused: sethostname: {os.strerror(ctypes.get_errno())}"
        return "set a hostname (the host's, unless the UTS namespace is its own)"

    found: dict[str, takeover.Attempt] = {
        "the pod's own file": lambda h, own=stat_of(targets["own"]): open_from_anywhere(
            h, str(targets["own"]), os.O_RDONLY, same_file(own)),
        "/etc/shadow": lambda h, etc=stat_of("/etc/shadow"): open_from_anywhere(
            h, "/etc/shadow", os.O_RDONLY, same_file(etc)),
        "another pod's file": lambda h, other=stat_of(targets["other"]): open_from_anywhere(
            h, str(targets["other"]), os.O_RDONLY, same_file(other)),
        "a loopback listener": lambda h: connect(socket.AF_INET,
                                                 ("127.0.0.1", targets["port"])),
        "an abstract unix socket": lambda h: connect(socket.AF_UNIX, targets["abstract"]),
        "SysV shared memory": shm,
        "the hostname": hostname,
    }
    for path in PROC_TARGETS:
        if os.path.exists(path):  # sysrq-trigger: a kernel with CONFIG_MAGIC_SYSRQ
            found[path] = lambda h, path=path: open_from_anywhere(h, path, os.O_WRONLY,
                                                                   in_proc)
    return found


def assert_only_the_pod_s_files(outcome: dict[str, str], targets: dict) -> None:
    assert outcome.pop("the pod's own file").startswith("reached"), \
        "the takeover does not even reach the pod's files: it proves nothing"
    reached = {name: said for name, said in outcome.items() if not said.startswith("refused")}
    assert reached == {}, reached
    assert socket.gethostname() == targets["hostname"]


async def test_a_takeover_of_the_default_daemon_reaches_only_the_pod_s_files(tmp_path) -> None:
    """The default daemon (podvm's Rust one, as shim/config.py picks it on a node) with
    all it holds, its filter included."""
    with host_targets(tmp_path) as targets:
        async with serving(tmp_path) as pid:
            outcome = takeover.take_over(pid, attempts(targets))
            exe = os.readlink(f"/proc/{pid}/exe")
            own = [ns for ns in ("mnt", "pid", "net", "ipc", "uts")
                   if os.readlink(f"/proc/{pid}/ns/{ns}") != os.readlink(f"/proc/self/ns/{ns}")]
            powers = takeover.powers_of(pid)
    assert_only_the_pod_s_files(outcome, targets)
    assert exe == os.path.realpath(rust_virtiofsd())
    assert own == ["mnt", "pid", "net", "ipc", "uts"]
    assert powers.no_new_privs and powers.bounding == 0 and powers.filters


async def test_past_its_filter_its_namespaces_and_credentials_still_hold(tmp_path) -> None:
    """A takeover that also got past the seccomp filter (a kernel bug, a daemon version
    whose filter allows more): its namespaces and credentials alone keep it in. The
    host's SysV IPC is where the IPC namespace the shim adds is what holds: root owns
    root's segments whatever its capabilities."""
    with host_targets(tmp_path) as targets:
        async with serving(tmp_path, virtio_fs_daemon=rust_virtiofsd()) as pid:
            outcome = takeover.take_over(pid, attempts(targets), with_filter=False)
    assert_only_the_pod_s_files(outcome, targets)


async def test_the_c_daemon_runs_only_under_its_key_and_reaches_the_host_s_proc(
        tmp_path) -> None:
    """QEMU 7.2's virtiofsd opens /proc/self/task before it hides /proc behind
    /proc/self/fd, and keeps it: `../../sys` from it is the host's sysctls, writable by
    its root. Refused without allow_legacy_virtiofsd (nothing starts); with it, this is
    the weaker isolation the key admits to."""
    daemon = virtiofs_daemon("qemu-7.2")
    unallowed = spec(tmp_path, virtio_fs_daemon=daemon, allow_legacy_virtiofsd=False)
    os.makedirs(unallowed.workdir)
    with pytest.raises(HypervisorError, match="allow_legacy_virtiofsd = true"):
        await virtiofsd.FileServer(unallowed).start(None)
    assert not os.path.exists(os.path.join(unallowed.workdir, "virtiofs.sock"))
    with host_targets(tmp_path) as targets:
        async with serving(tmp_path, virtio_fs_daemon=QEMU_VIRTIOFSD) as pid:
            outcome = takeover.take_over(pid, attempts(targets))
    assert outcome["the pod's own file"].startswith("reached")
    assert outcome["/proc/sys/kernel/core_pattern"].startswith("reached"), outcome


async def test_a_daemon_without_its_own_namespaces_never_runs_and_says_why(
        tmp_path, monkeypatch) -> None:
    """unshare refused (here: flags the kernel rejects): the daemon is not run outside
    its IPC and UTS namespaces, and its start says so."""
    monkeypatch.setattr(virtiofsd, "CLONE_NEWIPC", 1)
    s = spec(tmp_path)
    os.makedirs(s.workdir)
    server = virtiofsd.FileServer(s)
    with pytest.raises(HypervisorError, match="exited with status 126: podvm: no IPC and UTS "
                                              "namespaces of its own for virtiofsd: unshare: "
                                              "Invalid argument"):
        await server.start(None)
    await server.stop()
