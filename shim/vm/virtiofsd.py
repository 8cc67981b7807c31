"""The pod's file server: a virtiofsd per pod that serves its shared directory (the
read-only view shim/host/share.py builds, with each container's rootfs and volumes
attached in it) to the guest's virtio-fs device over a vhost-user socket in the VM's work
directory. Started with QEMU's `preexec` (the sandbox cgroup, so what it uses is the
pod's), before a booted QEMU, which connects at once, and beside a restored one, which
gets its device after the state (start_soon, ready); it ends by itself when QEMU's
connection goes, and is killed with the VM otherwise.

The daemon: the Rust one podvm ships (/opt/podvm/libexec/virtiofsd, the default:
shim/config.py), or QEMU 7.2's C one where the operator allows it (allow_legacy_virtiofsd:
it keeps a descriptor on its /proc after hiding /proc, and a guest that takes it over
writes /proc/sys/kernel/core_pattern through it, as tests/vm/test_virtiofsd_jail.py
shows), each told the same in its own words (command()).
What it is allowed, and why (docs/design.md, "Rooms and floors" names the room):
- sandbox=namespace: it pivots into the shared directory in mount, PID and network
  namespaces of its own, under its own seccomp filter (--seccomp=kill: a call outside
  it ends the daemon), so a guest that took it over reaches the pod's files and nothing
  else; the shim adds IPC and UTS namespaces (in_own_namespaces), which no daemon makes;
- root in the host's user namespace, with only chown, dac_override, fowner, fsetid,
  setuid and setgid (its bounding set empty, no_new_privs): it makes and chowns files
  as the guest's users, so it needs those in the user namespace that owns the pod's
  file systems (containerd's snapshots, the node's volumes), the host's. A user
  namespace of its own would either shift every owner the guest sees (a range map), or
  map all ids to themselves and keep its uid 0 the host's root (identity), which is
  what the kernel checks for /proc/sys; another uid gains nothing either, as setuid
  (for acting as each guest user) takes it back to 0. What keeps it from the host is
  that nothing but the pod's files is in its reach, and the tests play that takeover;
- modcaps=-mknod:-setfcap: a guest device node would be a host device node in the pod's
  files, a guest's file capability one the host honours; FIFOs and sockets need none;
- every other extended attribute the guest sets is stored under `user.virtiofs.`
  (XATTR_MAP): a guest's `trusted.overlay.*` or `security.*` means nothing to the host,
  and the host's own attributes are hidden from the guest, but for the image's file
  capabilities, which the guest reads (and honours in the guest, as runc's host would);
- posix_lock and flock (the C daemon): record and whole-file locks, held in the host's
  kernel; the Rust daemon leaves them to the guest's kernel (command());
- announce_submounts: each volume is its own file system in the guest (st_dev, statfs);
- --rlimit-nofile at the inherited hard limit (it holds a descriptor per file the guest
  looks up, and raising the hard limit would need CAP_SYS_RESOURCE)."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import resource
import signal
from typing import Callable

import psutil

from ..libc import last_errno, libc
from . import vmmlog
from .hypervisor import HypervisorError, VMSpec

log = logging.getLogger("podvm.virtiofsd")

XATTR_MAP = ":ok:all:security.capability:security.capability::map::user.virtiofs.:"
"""security.capability as it is, both ways (QEMU 7.2's virtiofsd fails every chown, EBADF,
once that name is remapped), which it cannot set (no setfcap); every other name under
`user.virtiofs.`. An `ok` rule matches the guest's names by its key and the host's (in
listings) by its prepend field: with an empty one every host name was listed as it is
(tests/e2e/test_confinement.py lists them)."""
START_TIMEOUT = 10  # seconds: a host process binding a socket, not a guest booting
CLONE_NEWIPC, CLONE_NEWUTS = 0x08000000, 0x04000000
_LISTENING = 0x00010000  # __SO_ACCEPTCON in /proc/net/unix's Flags


def command(spec: VMSpec, separate_options: bool) -> list[str]:
    """virtiofsd's command line: a daemon that announces "separate-options" (the Rust
    one: /usr/libexec/virtiofsd on Debian 13 and Ubuntu 24.04) takes each option as its
    own flag; QEMU 7.2's C daemon takes them as `-o` words. Where their behaviour
    differs: the C one holds the guest's record and whole-file locks in the host's kernel
    (posix_lock, flock), the Rust one has no such option and the guest's kernel keeps
    them among the guest's own processes (the pod's containers are all there). Neither
    serves FUSE_TMPFILE (the Rust one's 1.13 answers ENOSYS): O_TMPFILE in a volume
    fails in the guest whichever runs."""
    q = spec.hypervisor
    nofile = min(resource.getrlimit(resource.RLIMIT_NOFILE)[1], 1_000_000)
    sock = f"--socket-path={virtio_fs_socket(spec.workdir)}"
    if separate_options:
        cache = "never" if q.virtio_fs_cache == "none" else q.virtio_fs_cache
        return [q.virtio_fs_daemon, sock, f"--shared-dir={spec.shared_dir}",
                f"--cache={cache}", "--sandbox=namespace", "--seccomp=kill",
                "--modcaps=-mknod:-setfcap", "--xattr", f"--xattrmap={XATTR_MAP}",
                "--announce-submounts", "--allow-direct-io", f"--rlimit-nofile={nofile}"]
    return [q.virtio_fs_daemon, sock,
            "-o", f"source={spec.shared_dir}", "-o", f"cache={q.virtio_fs_cache}",
            "-o", "sandbox=namespace", "-o", "modcaps=-mknod:-setfcap",
            "-o", f"xattrmap={XATTR_MAP}", "-o", "posix_lock", "-o", "flock",
            "-o", "announce_submounts", "-o", "allow_direct_io",
            f"--rlimit-nofile={nofile}"]


async def separate_options(daemon: str) -> bool:
    """The daemon's vhost-user capabilities list "separate-options" (the Rust one)."""
    announced = await capabilities(daemon)
    return announced is not None and "separate-options" in announced["features"]


def is_legacy(announced: dict | None) -> bool:
    """What capabilities() read is QEMU 7.2's C daemon: a vhost-user file system backend
    without "separate-options". Anything else (no answer, or not one of a file system
    backend) is started with the Rust daemon's words: its start says what is wrong."""
    return announced is not None and announced.get("type") == "fs" and \
        "separate-options" not in announced["features"]


def in_own_namespaces(preexec: Callable[[], None] | None) -> Callable[[], None]:
    """`preexec`, then new IPC and UTS namespaces for the daemon: its sandbox makes mount,
    PID and network ones, not these, and a daemon that is root in the host's IPC
    namespace owns the SysV shared memory, semaphores and queues of every root process
    of the node. Said in its log when they cannot be made (it never runs then)."""
    c = libc()  # loaded before the fork

    def child() -> None:
        if preexec is not None:
            preexec()
        if c.unshare(CLONE_NEWIPC | CLONE_NEWUTS) != 0:
            err = last_errno()
            os.write(2, f"podvm: no IPC and UTS namespaces of its own for virtiofsd: "
                        f"unshare: {os.strerror(err)}\n".encode())
            os._exit(126)
    return child


async def capabilities(daemon: str) -> dict | None:
    """The daemon's vhost-user capabilities (`--print-capabilities`, the JSON that QEMU's
    vhost-user.json describes), "features" always a list; None for anything else."""
    try:
        proc = await asyncio.create_subprocess_exec(
            daemon, "--print-capabilities", stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
    except OSError:
        return None
    try:
        async with asyncio.timeout(START_TIMEOUT):
            out, _ = await proc.communicate()
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return None
    try:
        announced = json.loads(out)
    except ValueError:
        return None
    if not isinstance(announced, dict) or not isinstance(announced.get("features", []), list):
        return None
    return dict(announced, features=announced.get("features", []))


def virtio_fs_socket(workdir: str) -> str:
    """The vhost-user socket virtiofsd listens on and QEMU connects to
    (shim/vm/qemu/command.py names it on QEMU's command line)."""
    return os.path.join(workdir, "virtiofs.sock")


def log_path(spec: VMSpec) -> str:
    return os.path.join(spec.workdir, "virtiofsd.log")


class FileServer:
    def __init__(self, spec: VMSpec) -> None:
        self.spec = spec
        self._proc: asyncio.subprocess.Process | None = None
        self._starting: asyncio.Future[None] | None = None

    @property
    def pid(self) -> int:
        return self._proc.pid if self._proc is not None else 0

    def start_soon(self, preexec: Callable[[], None] | None) -> None:
        """start() under way while the caller goes on; ready() waits for it (a restored
        VM needs its file server only when its device is added, after the state)."""
        self._starting = asyncio.ensure_future(self.start(preexec))

    async def ready(self) -> None:
        """start_soon()'s start done: its error, if it failed."""
        assert self._starting is not None
        await asyncio.shield(self._starting)

    async def start(self, preexec: Callable[[], None] | None) -> None:
        """virtiofsd running and listening on its socket; HypervisorError with its own
        words when it does not get there."""
        sock = virtio_fs_socket(self.spec.workdir)
        try:
            os.unlink(sock)
        except FileNotFoundError:
            pass
        daemon = self.spec.hypervisor.virtio_fs_daemon
        announced = await capabilities(daemon)
        if is_legacy(announced) and not self.spec.hypervisor.allow_legacy_virtiofsd:
            raise HypervisorError(
                f"virtiofsd {daemon} is QEMU 7.2's C daemon, which a guest that takes it "
                f"over leaves for the host's /proc: podvm runs it only with "
                f"allow_legacy_virtiofsd = true in [hypervisor.qemu] of "
                f"{self.spec.config_source or 'its configuration'} (weaker isolation); "
                f"unset virtio_fs_daemon for podvm's own Rust daemon")
        cmd = command(self.spec, not is_legacy(announced))
        preexec = in_own_namespaces(preexec)
        log.info("starting virtiofsd: %s", " ".join(cmd))
        out = vmmlog.PipeLog(log_path(self.spec))  # bounded, read by descriptors
        try:
            self._proc = await asyncio.create_subprocess_exec(
                *cmd, stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=out,
                start_new_session=True, preexec_fn=preexec)
        except OSError as exc:
            raise HypervisorError(f"cannot run virtiofsd {cmd[0]}: {exc.strerror} (run `make "
                                  f"install` for podvm's own, or set virtio_fs_daemon)") from None
        finally:
            out.close()
        try:
            async with asyncio.timeout(START_TIMEOUT):
                while not _listening(sock):
                    if self._proc.returncode is not None:
                        raise HypervisorError(
                            f"virtiofsd of sandbox {self.spec.sandbox_id} exited with status "
                            f"{self._proc.returncode}: {self.said()}")
                    await asyncio.sleep(0.002)
        except TimeoutError:
            await self.stop()
            raise HypervisorError(f"virtiofsd of sandbox {self.spec.sandbox_id} did not "
                                  f"listen on {sock} within {START_TIMEOUT} s: "
                                  f"{self.said()}") from None
        except BaseException:
            await self.stop()
            raise

    def said(self) -> str:
        return vmmlog.tail(log_path(self.spec), 1000) or "(nothing)"

    def pids(self) -> list[int]:
        """It and the child it serves from (in a PID namespace of its own)."""
        if self.pid <= 0 or (self._proc is not None and self._proc.returncode is not None):
            return []
        try:
            return [self.pid, *(p.pid for p in psutil.Process(self.pid).children(True))]
        except psutil.NoSuchProcess:
            return []

    def threads(self) -> list[int]:
        tids: list[int] = []
        for pid in self.pids():
            try:
                tids.extend(t.id for t in psutil.Process(pid).threads())
            except psutil.NoSuchProcess:
                pass
        return sorted(tids)

    async def stop(self, timeout: float = 2) -> None:
        """Gone, and a start under way given up; it normally ends by itself once QEMU
        has hung up."""
        starting, self._starting = self._starting, None
        if starting is not None and starting is not asyncio.current_task():
            starting.cancel()  # done already: nothing
            await asyncio.gather(starting, return_exceptions=True)
        proc = self._proc
        if proc is None or proc.returncode is not None:
            return
        try:
            await asyncio.wait_for(proc.wait(), timeout)
            return
        except TimeoutError:
            pass
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass
            try:
                await asyncio.wait_for(proc.wait(), timeout)
                return
            except TimeoutError:
                log.warning("virtiofsd %d did not end on signal %d", proc.pid, sig)


def _listening(path: str) -> bool:
    """A unix socket bound at `path` is listening (connecting to find out would take
    virtiofsd's one connection)."""
    try:
        with open("/proc/self/net/unix") as f:
            next(f)
            for line in f:
                fields = line.split()
                if len(fields) >= 8 and fields[7] == path and int(fields[3], 16) & _LISTENING:
                    return True
    except OSError:
        pass
    return False
