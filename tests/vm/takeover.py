"""A takeover of a running process, played by the tests: code run with what that process
holds, as an attacker who controls it would run it. Its credentials (uids, gids, groups,
capabilities, bounding set, no_new_privs), every namespace it is in, its root and working
directory, a copy of every descriptor it has open (pidfd_getfd) and its seccomp filter,
copied instruction for instruction (PTRACE_SECCOMP_GET_FILTER) and installed last. Each
attempt runs in a process of its own, so that one the filter kills (SIGSYS) leaves the
others to run; none of them needs anything the target lacks.

Used on the pod's virtiofsd (tests/vm/test_virtiofsd_jail.py): what a guest that took it
over reaches is what these attempts reach."""
from __future__ import annotations

import ctypes
import json
import os
import signal
from dataclasses import dataclass
from typing import Callable

NAMESPACES = ("ipc", "uts", "net", "pid", "mnt")
"""Entered in this order: the mount namespace last, as it takes /proc away."""
PROC_SUPER_MAGIC = 0x9FA0
_PTRACE_DETACH, _PTRACE_SEIZE, _PTRACE_INTERRUPT = 17, 0x4206, 0x4207
_PTRACE_SECCOMP_GET_FILTER = 0x420C
_SYS_PTRACE, _SYS_CAPSET, _SYS_SECCOMP, _SYS_PIDFD_GETFD = 101, 126, 317, 438
_PR_SET_KEEPCAPS, _PR_CAPBSET_DROP, _PR_SET_NO_NEW_PRIVS, _PR_CAP_AMBIENT = 8, 24, 38, 47
_CAP_AMBIENT_CLEAR_ALL = 4
_CAP_VERSION_3 = 0x20080522
_WALL = 0x40000000
CAP_LAST = 40

Attempt = Callable[["Held"], str]
"""An attack: what it reached ("reached ...") or why not ("refused ..."); it runs with
the target's powers and may use only what the target holds."""


@dataclass(frozen=True)
class Powers:
    """What the kernel says a process holds (/proc/PID/status and its filter)."""

    pid: int
    uids: tuple[int, int, int]
    gids: tuple[int, int, int]
    groups: tuple[int, ...]
    effective: int
    permitted: int
    inheritable: int
    bounding: int
    no_new_privs: bool
    filters: tuple[bytes, ...]
    """Its seccomp filters, the oldest first (classic BPF, 8 bytes an instruction)."""


@dataclass(frozen=True)
class Held:
    """What an attempt starts from: the target's descriptors, as copies, by its numbers,
    and its root (it runs chrooted there, in the target's working directory)."""

    descriptors: dict[int, int]
    root: int

    def starts(self) -> list[tuple[str, int]]:
        return [("its root", self.root),
                *((f"its descriptor {n}", fd) for n, fd in sorted(self.descriptors.items()))]


_loaded: ctypes.CDLL | None = None


def _libc() -> ctypes.CDLL:
    """Loaded before any fork: an attempt under the filter loads nothing."""
    global _loaded
    if _loaded is not None:
        return _loaded
    _loaded = c = ctypes.CDLL(None, use_errno=True)
    c.syscall.restype = ctypes.c_long
    c.shmat.restype = ctypes.c_void_p
    c.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    c.sethostname.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    return c


def _syscall(c: ctypes.CDLL, number: int, *args: int | ctypes._CData | None) -> int:
    argv = [ctypes.c_long(a) if isinstance(a, int) else a for a in args]
    result = c.syscall(ctypes.c_long(number), *argv)
    if result == -1:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return result


def powers_of(pid: int) -> Powers:
    """The process's powers, its filter read through ptrace by a forked child (it stops
    the process for the read)."""
    status = dict(line.split(":", 1) for line in
                  open(f"/proc/{pid}/status").read().splitlines() if ":" in line)

    def ids(name: str) -> tuple[int, int, int]:
        real, effective, saved, _ = (int(v) for v in status[name].split())
        return real, effective, saved

    return Powers(pid=pid, uids=ids("Uid"), gids=ids("Gid"),
                  groups=tuple(int(g) for g in status["Groups"].split()),
                  effective=int(status["CapEff"], 16), permitted=int(status["CapPrm"], 16),
                  inheritable=int(status["CapInh"], 16), bounding=int(status["CapBnd"], 16),
                  no_new_privs=status["NoNewPrivs"].strip() == "1",
                  filters=tuple(reversed(_filters(pid)))
                  if int(status["Seccomp"]) == 2 else ())


def in_child(fn: Callable[[], object]) -> object:
    """`fn()` run in a forked child (to change its namespaces, ids and filters without
    touching the test's process): its JSON-able result, or RuntimeError with what it
    raised or that it died."""
    read, write = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(read)
        answer: dict = {"error": "no answer"}
        try:
            answer = {"result": fn()}
        except BaseException as exc:  # noqa: BLE001 - said to the parent
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            os.write(write, json.dumps(answer).encode())
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        answer = json.loads(f.read() or b'{"error": "the child died"}')
    os.waitpid(child, 0)
    if "error" in answer:
        raise RuntimeError(answer["error"])
    return answer["result"]


def _filters(pid: int) -> list[bytes]:
    """The process's filters, the newest first: PTRACE_SECCOMP_GET_FILTER on it stopped."""
    c = _libc()

    def read_filters() -> list[str]:
        _syscall(c, _SYS_PTRACE, _PTRACE_SEIZE, pid, 0, 0)
        _syscall(c, _SYS_PTRACE, _PTRACE_INTERRUPT, pid, 0, 0)
        os.waitpid(pid, _WALL)
        found = []
        while True:
            try:
                count = _syscall(c, _SYS_PTRACE, _PTRACE_SECCOMP_GET_FILTER, pid,
                                 len(found), 0)
            except OSError as exc:
                if exc.errno == 2:  # ENOENT: no filter at that index
                    break
                raise
            program = ctypes.create_string_buffer(count * 8)
            _syscall(c, _SYS_PTRACE, _PTRACE_SECCOMP_GET_FILTER, pid, len(found), program)
            found.append(program.raw.hex())
        _syscall(c, _SYS_PTRACE, _PTRACE_DETACH, pid, 0, 0)
        return found

    try:
        return [bytes.fromhex(h) for h in in_child(read_filters)]
    except RuntimeError as exc:
        raise OSError(f"the seccomp filter of {pid}: {exc}") from None


def take_over(pid: int, attempts: dict[str, Attempt],
              with_filter: bool = True) -> dict[str, str]:
    """Each attempt's outcome, run with the powers of process `pid` (with_filter=False:
    all but its seccomp filter, what a takeover that also got past the filter, or a
    daemon whose filter allowed more, would have)."""
    powers = powers_of(pid)
    c = _libc()
    try:
        return in_child(lambda: _enter_and_attempt(c, powers, attempts, with_filter))
    except RuntimeError as exc:
        raise RuntimeError(f"the takeover of {pid} could not be set up: {exc}") from None


def _enter_and_attempt(c: ctypes.CDLL, powers: Powers, attempts: dict[str, Attempt],
                       with_filter: bool) -> dict[str, str]:
    """In a forked child of the test: the target's descriptors copied, its namespaces
    entered, its root taken; then a child in its PID namespace runs the attempts."""
    pid = powers.pid
    if os.readlink(f"/proc/{pid}/ns/user") != os.readlink("/proc/self/ns/user"):
        raise OSError("the target is in a user namespace of its own: not played here")
    pidfd = os.pidfd_open(pid)
    descriptors = {}
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            descriptors[int(name)] = _syscall(c, _SYS_PIDFD_GETFD, pidfd, int(name), 0)
        except OSError:
            pass  # closed meanwhile
    os.close(pidfd)
    namespaces = [os.open(f"/proc/{pid}/ns/{ns}", os.O_RDONLY) for ns in NAMESPACES]
    root = os.open(f"/proc/{pid}/root", os.O_PATH | os.O_DIRECTORY)
    cwd = os.open(f"/proc/{pid}/cwd", os.O_PATH | os.O_DIRECTORY)
    for ns, fd in zip(NAMESPACES, namespaces):
        if c.setns(fd, 0) != 0:
            raise OSError(ctypes.get_errno(), f"setns into its {ns} namespace")
        os.close(fd)
    os.fchdir(root)
    os.chroot(".")
    os.fchdir(cwd)
    os.close(cwd)
    held = Held(descriptors=descriptors, root=root)
    read, write = os.pipe()
    inner = os.fork()  # in its PID namespace: setns moves only the children
    if inner == 0:
        os.close(read)
        results = {name: _attempt(c, powers, held, attempt, with_filter)
                   for name, attempt in attempts.items()}
        os.write(write, json.dumps(results).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        data = f.read()
    os.waitpid(inner, 0)
    return json.loads(data or b'{"error": "the attempts died"}')


def _attempt(c: ctypes.CDLL, powers: Powers, held: Held, attempt: Attempt,
             with_filter: bool) -> str:
    read, write = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(read)
        said = "refused: the attempt raised"
        try:
            _become(c, powers, with_filter)
            said = attempt(held)
        except BaseException as exc:  # noqa: BLE001 - the outcome
            said = f"refused: {type(exc).__name__}: {exc}"
        finally:
            os.write(write, said.encode())
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        said = f.read().decode()
    _, status = os.waitpid(child, 0)
    if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGSYS:
        return "refused: killed by its seccomp filter"
    return said or f"refused: the attempt ended with status {status}"


def _become(c: ctypes.CDLL, powers: Powers, with_filter: bool) -> None:
    """This process with the target's credentials, capabilities and filter."""
    os.setgroups(list(powers.groups))
    os.setresgid(*powers.gids)
    if c.prctl(_PR_SET_KEEPCAPS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "PR_SET_KEEPCAPS")
    os.setresuid(*powers.uids)
    for cap in range(CAP_LAST + 1):
        if not powers.bounding >> cap & 1:
            c.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0)  # EINVAL past the kernel's last
    c.prctl(_PR_CAP_AMBIENT, _CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    if powers.no_new_privs and c.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS")
    filters = powers.filters if with_filter else ()
    if filters and not powers.no_new_privs:
        _install(c, filters)  # needs CAP_SYS_ADMIN, not kept past capset
        filters = ()
    header = (ctypes.c_uint32 * 2)(_CAP_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)(powers.effective & 0xFFFFFFFF, powers.permitted & 0xFFFFFFFF,
                                 powers.inheritable & 0xFFFFFFFF, powers.effective >> 32,
                                 powers.permitted >> 32, powers.inheritable >> 32)
    _syscall(c, _SYS_CAPSET, header, data)
    _install(c, filters)


def _install(c: ctypes.CDLL, filters: tuple[bytes, ...]) -> None:
    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]

    for program in filters:
        fprog = Program(len(program) // 8, program)
        _syscall(c, _SYS_SECCOMP, 1, 0, ctypes.byref(fprog))  # SECCOMP_SET_MODE_FILTER


# Attempts: each tries every way the target's powers give it.

def open_from_anywhere(held: Held, path: str, flags: int,
                       is_it: Callable[[int], bool]) -> str:
    """`path` (a host path) opened from every start the target has (its root, each of its
    descriptors), with up to 6 `..` first and any tail of the path's components (a
    descriptor on /proc reaches /proc/sys as `../../sys`): "reached" when what opened is
    the host's file (`is_it`, on the descriptor)."""
    parts = path.strip("/").split("/")
    for label, fd in held.starts():
        for first in range(len(parts)):
            for up in range(7):
                rel = "../" * up + "/".join(parts[first:])
                try:
                    opened = os.open(rel, flags | os.O_CLOEXEC | os.O_NOCTTY, dir_fd=fd)
                except OSError:
                    continue
                try:
                    if is_it(opened):
                        return f"reached {path} through {label} as {rel}"
                finally:
                    os.close(opened)
    return f"refused: {path} from none of {len(held.starts())} starts"


def in_proc(fd: int) -> bool:
    """The descriptor is on a procfs (not a file of that name among the pod's)."""
    buf = ctypes.create_string_buffer(120)  # struct statfs; f_type first
    if _libc().fstatfs(fd, buf) != 0:
        return False
    return int.from_bytes(buf.raw[:8], "little") == PROC_SUPER_MAGIC


def same_file(dev_ino: tuple[int, int]) -> Callable[[int], bool]:
    def check(fd: int) -> bool:
        st = os.fstat(fd)
        return (st.st_dev, st.st_ino) == dev_ino
    return check
