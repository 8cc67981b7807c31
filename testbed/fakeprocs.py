"""The fake guest's processes (testbed/fakeagent.py runs them): a container's or an exec's
process as a plain child of the fake guest on the host, with the state the shim and the
guest's agent keep (podvm_core/procstate.py's Lifecycle), its stdio, and its exit.

- a process runs its OCI args with the spec's env, in "/" of the host: the host's
  program of that path, else /bin/busybox's applet of that name, else (`/pause`, a pod's
  namespace holder) a stand-in that waits until it is signalled (TERM and INT end it
  with status 0, as the pause container and the guest's namespace holder do). A program
  the container's root (the pod's share, which the fake guest sees in the pod's mount
  namespace) does not have is refused first, as runc refuses it. Nothing is run in the
  root itself (the host mounts the share noexec), so a process that writes a file
  writes the host's: a test on a FakeVM runs commands that write only to their stdio;
- a container's init is made when created and runs its program once started (the
  shell it starts as waits for StartContainer), in a process group of its own; an exec
  runs at once, in its own group; exit statuses are the real ones (128+n when killed
  by signal n);
- every child gets SIGKILL when the fake guest dies (PR_SET_PDEATHSIG), as processes go
  with their VM; what a child forks is reached through its process group while the fake
  guest lives."""
from __future__ import annotations

import asyncio
import ctypes
import fcntl
import os
import signal
import subprocess
import termios
import time

from podvm_core.fdio import FdStream
from podvm_core.pb.agent import agent_pb2 as pb
from podvm_core.procstate import Lifecycle, pick
from podvm_core.ttrpc import Code, TtrpcError


BUSYBOX = "/bin/busybox"
WAITER = "trap 'exit 0' TERM INT; while read -r _ <&{fd}; do :; done; exit 0"
"""A program the host does not have: waits (on a pipe the agent never writes) until
signalled, or until the fake guest dies (end of file)."""
GATE = 'read -r _ <&{fd} || exit 1; exec "$@" {fd}<&-'
"""A created container's init: waits for StartContainer (a line on fd), then is its
program (same pid)."""
GUEST_SHARED = "/run/podvm/shared"
"""The share's path in a guest (shim/vm/guestspec.py): the fake guest's is the host's."""
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_applets: set[str] = set()


def check_program(args: list[str], env: list[str], root: str, who: str) -> None:
    """runc's refusal of a program the container's root (`root`, on the host) does not
    have; nothing is checked without a root the host can see."""
    if not args:
        raise TtrpcError(Code.INVALID_ARGUMENT, f"{who}: no process args")
    if not root or not os.path.isdir(root):
        return
    path = next((e[5:] for e in env if e.startswith("PATH=")), DEFAULT_PATH)
    places = [args[0]] if "/" in args[0] else [f"{d}/{args[0]}" for d in path.split(":")]
    if not any(os.path.lexists(os.path.join(root, p.lstrip("/"))) for p in places):
        raise TtrpcError(Code.FAILED_PRECONDITION,
                         f"runc create failed: unable to start container process: exec: "
                         f"\"{args[0]}\": stat {args[0]}: no such file or directory")


def host_argv(args: list[str]) -> list[str] | None:
    """`args` as this host runs them: the host's program or busybox applet of that name;
    None: neither has it (WAITER). Not the container root's own: the host mounts the
    share noexec."""
    if not _applets:
        _applets.update(subprocess.run([BUSYBOX, "--list"], capture_output=True,
                                       check=True).stdout.decode().split())
    if os.path.isabs(args[0]) and os.path.isfile(args[0]):
        return list(args)
    name = os.path.basename(args[0])
    return [BUSYBOX, name, *args[1:]] if name in _applets else None


PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)


def die_with_parent() -> None:
    """In a child before exec: SIGKILL when the fake guest dies (as processes in a guest
    die with their VM)."""
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)

class Proc(Lifecycle):
    popen: subprocess.Popen | None = None
    stdin: FdStream | None = None
    stdout: FdStream | None = None
    stderr: FdStream | None = None
    pty: FdStream | None = None
    gate = -1
    """The write end of the pipe its GATE or WAITER reads; -1 once started."""
    waiter = False
    """It runs WAITER: starting it changes nothing (the pipe stays open)."""

    def stream(self, name: str) -> FdStream | None:
        if self.pty is not None:
            return self.pty if name in ("stdout", "stdin") else None
        return getattr(self, name)

    def open_gate(self) -> None:
        if self.gate >= 0 and not self.waiter:
            os.write(self.gate, b"go\n")
            os.close(self.gate)
            self.gate = -1

    def close(self) -> None:
        for s in (self.stdin, self.stdout, self.stderr, self.pty):
            if s is not None:
                s.close()
        if self.gate >= 0:
            os.close(self.gate)
            self.gate = -1


class Box:
    """A container: its init, its execs; a holder stands for a pod's namespaces."""

    def __init__(self, id: str, sandbox: bool, init: Proc, holder: bool = False) -> None:
        self.id, self.sandbox, self.init, self.holder = id, sandbox, init, holder
        self.execs: dict[str, Proc] = {}
        self.root = ""
        """Its root on the host (the share's), where its programs are looked for."""
        self.memory_limit = 0
        """The memory limit its spec or UpdateContainer gave last (0: none)."""

    def process(self, exec_id: str) -> Proc:
        return pick(self.id, self.init, self.execs, exec_id)

    def groups(self) -> list[int]:
        return [p.popen.pid for p in (self.init, *self.execs.values()) if p.popen]

    def signal_groups(self, signum: int) -> int:
        """`signum` to every process group of the container; how many got it."""
        reached = 0
        for group in self.groups():
            try:
                os.killpg(group, signum)
                reached += 1
            except (ProcessLookupError, PermissionError):
                pass
        return reached


def spawn(proc: Proc, args: list[str], env: list[str], want: pb.Stdio | None,
          gated: bool) -> None:
    """Run `args` for `proc` (GATE first when `gated`), its stdio as `want` says; its exit
    recorded when it comes."""
    argv = host_argv(args) if args else None
    read_end, proc.gate = os.pipe()
    script = WAITER if argv is None else GATE if gated else ""
    proc.waiter = argv is None
    if script:
        argv = [BUSYBOX, "sh", "-c", script.format(fd=read_end), "sh", *(argv or [])]
    else:
        os.close(proc.gate)
        proc.gate = -1
    devnull = os.open(os.devnull, os.O_RDWR)
    child, ours, terminal = [devnull] * 3, {}, bool(want and want.terminal)
    if terminal:
        master, slave = os.openpty()
        child, ours = [slave] * 3, {"pty": master}
    elif want is not None:
        for index, name in enumerate(("stdin", "stdout", "stderr")):
            if getattr(want, name):
                r, w = os.pipe()
                child[index], ours[name] = (r, w) if index == 0 else (w, r)

    def setup() -> None:
        die_with_parent()
        if terminal:
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    try:
        assert argv is not None
        proc.popen = subprocess.Popen(
            argv, stdin=child[0], stdout=child[1], stderr=child[2], cwd="/",
            env=dict(e.split("=", 1) for e in env if "=" in e), start_new_session=True,
            pass_fds=[read_end], preexec_fn=setup)
    except OSError as exc:
        for fd in ours.values():
            os.close(fd)
        raise TtrpcError(Code.INVALID_ARGUMENT, f"{proc.name}: cannot run {args}: {exc}")
    finally:
        for fd in {read_end, devnull, *child}:
            os.close(fd)
    for name, fd in ours.items():
        setattr(proc, name, FdStream(fd))
    proc.pid = proc.popen.pid
    _follow(proc)


def memory_limit(resources: dict | None) -> int:
    """An OCI LinuxResources' memory limit, as the container's cgroup would have it."""
    limit = ((resources or {}).get("memory") or {}).get("limit") or 0
    return limit if isinstance(limit, int) and limit > 0 else 0


def _follow(proc: Proc) -> None:
    assert proc.popen is not None
    popen, loop, pidfd = proc.popen, asyncio.get_running_loop(), os.pidfd_open(proc.pid)

    def exited() -> None:
        status = popen.poll()
        if status is None:
            return
        loop.remove_reader(pidfd)
        os.close(pidfd)
        proc.set_exited(128 - status if status < 0 else status, time.time_ns())

    loop.add_reader(pidfd, exited)
