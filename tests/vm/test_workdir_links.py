"""QEMU's work directory is QEMU's to write (shim/vm/workdir.py): a QEMU a guest took over
plants a symlink, or a FIFO, at every name the shim opens, writes, renames, connects to
or removes there. The shim follows none (a link to a file standing for /etc/cron.d/x is
never written, a link to a secret never quoted) and never hangs on a FIFO, through a
real pod's start, a console flood past the cap, QEMU killed, and stop and delete."""
from __future__ import annotations

import asyncio
import ctypes
import errno
import os
import pathlib
import signal
import socket
from contextlib import contextmanager

import pytest

from shim.host.cleanup import remove_tree
from shim.libc import libc
from shim.host.mountns import in_namespace
from shim.vm import vmmlog
from shim.vm.agent import Agent
from shim.vm.cappedlog import CappedLog
from shim.vm.qemu.driver import QemuVM
from tests.vm.test_console import flood
from tests.vm.test_jail import spec as jail_spec

SECRET = b"root:$6$the-host-s-shadow-line\n"
CRONTAB = b"# the host's crontab, which no guest writes\n"


class Hung(Exception):
    """Not an OSError: the shim's own `except OSError` must not take it for a failed
    write and go on."""


@contextmanager
def no_hang(seconds: float):
    """The block ends within `seconds` or fails: a FIFO opened by the shim would block
    its whole event loop. SIGALRM interrupts the open and the handler raises, again
    each second after (a hang the shim swallowed and a later one are still seen)."""
    hung = []

    def expired(signum, frame):
        hung.append(signum)
        raise Hung(f"the shim hung for {seconds}s")
    old = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds, 1)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert not hung, f"the shim hung (blocked for more than {seconds}s)"


class Outside:
    """Files outside the work directory a planted link leads to: a crontab (to be
    written) and a secret (to be read, and quoted in an error)."""

    def __init__(self, base: pathlib.Path) -> None:
        base.mkdir(exist_ok=True)
        self.crontab, self.secret = base / "cron.d-x", base / "shadow"
        self.crontab.write_bytes(CRONTAB)
        self.secret.write_bytes(SECRET)
        self._before = self._state()

    def _state(self) -> list[tuple[bytes, int]]:
        return [(p.read_bytes(), p.stat().st_mtime_ns) for p in (self.crontab, self.secret)]

    def untouched(self) -> bool:
        return self._state() == self._before


def plant(directory: str, names: list[str], kind: str, outside: dict[str, str]) -> list[str]:
    """At each of `names` in `directory`: what was there removed, a symlink to
    `outside[name]` (kind "symlink") or a FIFO planted. The names planted."""
    planted = []
    for name in names:
        path = os.path.join(directory, name)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        if kind == "symlink":
            os.symlink(outside[name], path)
        else:
            os.mkfifo(path, 0o666)
        planted.append(name)
    return planted


# -- the pieces, without a VM ----------------------------------------------------------

@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_a_console_compaction_follows_no_planted_temporary_file(tmp_path, kind) -> None:
    outside = Outside(tmp_path / "etc")
    work = tmp_path / "vm"
    work.mkdir()
    log = CappedLog(str(work / "console.log"), 100)
    plant(str(work), [f"console.log.{os.getpid()}.tmp"], kind,
          {f"console.log.{os.getpid()}.tmp": str(outside.crontab)})
    with no_hang(5):
        log.write(b"a" * 90)
        log.write(b"* * * * * root sh -c 'id > /tmp/pwned'\n")  # past the cap: compacted
    assert outside.untouched()
    assert (work / "console.log").read_bytes().endswith(b"/tmp/pwned'\n")
    assert os.path.lexists(work / f"console.log.{os.getpid()}.tmp")  # left as planted


@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_a_log_planted_as_a_link_or_fifo_is_not_quoted_and_does_not_hold_the_shim(
        tmp_path, kind) -> None:
    outside = Outside(tmp_path / "etc")
    work = tmp_path / "vm"
    work.mkdir()
    plant(str(work), ["qemu.log"], kind, {"qemu.log": str(outside.secret)})
    with no_hang(5):
        said = vmmlog.tail(str(work / "qemu.log"))
    assert said == ""
    (work / "real.log").write_bytes(b"first\nQEMU's last words\n")  # the control
    assert vmmlog.tail(str(work / "real.log")) == "first | QEMU's last words"


def test_a_socket_planted_as_a_link_is_not_connected_to(tmp_path) -> None:
    from shim.vm import workdir  # the module of this defence
    elsewhere = socket.socket(socket.AF_UNIX)
    elsewhere.bind(str(tmp_path / "containerd.sock"))
    elsewhere.listen()
    work = tmp_path / "vm"
    work.mkdir()
    os.symlink(tmp_path / "containerd.sock", work / "qmp.sock")
    with pytest.raises(OSError) as err:
        with workdir.socket_path(str(work / "qmp.sock")):
            pass
    assert err.value.errno == errno.ENOTSOCK
    own = socket.socket(socket.AF_UNIX)
    own.bind(str(work / "agent.sock"))
    own.listen()
    with workdir.socket_path(str(work / "agent.sock")) as path:
        client = socket.socket(socket.AF_UNIX)
        client.connect(path)
        client.close()
    workdir.unlink(str(work / "qmp.sock"))
    assert not os.path.lexists(work / "qmp.sock")
    assert os.path.exists(tmp_path / "containerd.sock")
    elsewhere.close()
    own.close()


# -- a real pod, attacked from its QEMU ------------------------------------------------

def _credentials(pid: int) -> tuple[int, int, list[int], int]:
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            fields[key] = value.split()
    return (int(fields["Uid"][0]), int(fields["Gid"][0]),
            [int(g) for g in fields.get("Groups", [])], int(fields["CapEff"][0], 16))


def _as_qemu_plant(creds: tuple[int, int, list[int], int], directory: str,
                   names: list[str], kind: str, outside: dict[str, str]) -> list[str]:
    """In QEMU's mount namespace (in_namespace's setns), as QEMU's uid, gid and groups,
    with its capabilities and no more: the names planted."""
    uid, gid, groups, caps = creds
    os.setgroups(groups)
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)
    data = (ctypes.c_uint32 * 6)(caps & 0xFFFFFFFF, caps & 0xFFFFFFFF, 0,
                                 caps >> 32, caps >> 32, 0)
    if libc().syscall(125, ctypes.byref(header), ctypes.byref(data)):  # capset
        raise OSError(ctypes.get_errno(), "capset")
    libc().prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
    return plant(directory, names, kind, outside)


@pytest.mark.parametrize("kind", ["symlink", "fifo"])
async def test_qemu_s_planted_links_and_fifos_are_never_followed_through_a_pod_s_life(
        tmp_path, kind) -> None:
    outside = Outside(tmp_path / "etc")  # outside the jail: QEMU cannot see it
    s = jail_spec(tmp_path, boot_timeout=120, console_log_max_kib=4)
    vm = QemuVM(s)
    shim = os.getpid()
    # Every name the shim opens, writes, renames, connects to or removes there.
    reads = ["console.log", "qemu.log", "virtiofsd.log"]
    writes = [f"{n}.{shim}.tmp" for n in reads]
    sockets = ["qmp.sock", "agent.sock", "console.sock"]
    target = {**{n: str(outside.secret) for n in reads},
              **{n: str(outside.crontab) for n in writes + sockets}}
    await vm.launch()
    try:
        agent = Agent.of_vm(vm)
        await agent.ping(timeout=60)
        assert vm.spec.hypervisor.enable_jail
        planted = in_namespace(f"/proc/{vm.pid}/ns/mnt", _as_qemu_plant, _credentials(vm.pid),
                               vm.spec.workdir, reads + writes + sockets, kind, target)
        assert planted == reads + writes + sockets  # QEMU can: the test attacks
        work = pathlib.Path(vm.spec.workdir)
        assert all(os.path.lexists(work / n) for n in planted)
        with no_hang(120):
            await flood(agent, 200)  # ~20 KiB through a 4 KiB log: compacted many times
            await agent.ping()
            await agent.close()
            await asyncio.sleep(0.5)  # the console's last lines copied
            assert outside.untouched(), f"written through QEMU's link: {outside.crontab}"
            os.kill(vm.pid, signal.SIGKILL)  # the failure
            gone = await vm.exited(grace=10)
            assert gone is not None
            message = str(gone)
            tail = vm.console_tail()
            await vm.stop()
        assert "was killed by signal SIGKILL" in message
        assert SECRET.decode().strip() not in message + tail
        assert b"port 70199 is not a TCP port" in (work / "console.log").read_bytes()
        assert (work / "console.log").stat().st_size <= 4096
    finally:
        with no_hang(60):
            await vm.stop(timeout=0)
    with no_hang(30):
        remove_tree(vm.spec.workdir)  # what `delete` does with it
    assert not os.path.exists(vm.spec.workdir)
    assert outside.untouched()
