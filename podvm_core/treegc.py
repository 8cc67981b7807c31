"""Removing podvm's install trees (podvm_core/trees.py) once no process uses them: by
`podvm-node install` and `uninstall`, and by a shim's daemon as it exits after an
uninstall that left its tree (collect_retired). Not for `start`, which stays light."""
from __future__ import annotations

import fcntl
import os
import shutil
import signal
import sys
import time

from . import trees


def users(paths: list[str], exclude: int = 0, proc: str = "/proc") -> dict[str, list[int]]:
    """tree -> the pids whose executable, working directory or a mapped file is inside it
    (`paths`: trees' paths as the processes see them). A process of another uid that
    this one may not look into (a jailed QEMU, without CAP_SYS_PTRACE) counts as a user
    of every tree: what cannot be seen is never taken for unused."""
    found: dict[str, list[int]] = {t: [] for t in paths}
    inside = tuple(t.rstrip("/") + "/" for t in paths)
    for entry in os.listdir(proc):
        if not entry.isdigit() or int(entry) == exclude:
            continue
        seen: list[str] = []
        for link in ("exe", "cwd"):
            try:
                seen.append(os.readlink(f"{proc}/{entry}/{link}") + "/")
            except PermissionError:
                seen.extend(_closed(f"{proc}/{entry}", inside))
            except OSError:
                pass
        try:
            with open(f"{proc}/{entry}/maps") as f:
                for line in f:
                    fields = line.split(None, 5)
                    if len(fields) == 6 and fields[5].startswith("/"):
                        seen.append(fields[5].rstrip("\n"))
        except PermissionError:
            seen.extend(_closed(f"{proc}/{entry}", inside))
        except OSError:
            pass
        for path in seen:
            for tree, prefix in zip(paths, inside):
                if path.startswith(prefix) and int(entry) not in found[tree]:
                    found[tree].append(int(entry))
    return found


def _closed(process: str, inside: tuple[str, ...]) -> tuple[str, ...]:
    """What a process closed to this one is taken to use: every tree when it runs as
    another uid (what a jailed QEMU is); nothing when it is this one's uid, which only a
    security module's rule keeps out (such as a container host's own init)."""
    try:
        return inside if os.stat(process).st_uid != os.geteuid() else ()
    except OSError:  # gone
        return ()


def collect(host: str = "", keep_current: bool = True, exclude: int = 0) -> list[str]:
    """Remove the trees under the host's /opt/podvm that no process uses (`current`'s
    stays unless not `keep_current`); the names removed. A tree's processes see it at
    /opt/podvm/<name> (the host's own path) or, in a test's scratch root, at
    <host>/opt/podvm/<name>: either counts."""
    prefix = host + trees.PREFIX
    try:
        current = os.readlink(os.path.join(prefix, trees.CURRENT)) if keep_current else ""
    except OSError:
        current = ""
    candidates = [n for n in trees.names(prefix) if n != current]
    seen_as = _seen_as(host, candidates)
    used = users([p for paths in seen_as.values() for p in paths], exclude)
    removed = []
    for name in candidates:
        if not _stop_fork_servers({pid for p in seen_as[name] for pid in used[p]}):
            continue
        # renamed out of the way first: a half-removed tree is never a tree
        doomed = os.path.join(prefix, f".gone-{name}")
        try:
            os.rename(os.path.join(prefix, name), doomed)
        except FileNotFoundError:  # another collection took it
            continue
        shutil.rmtree(doomed, ignore_errors=True)
        removed.append(name)
    return removed


FORK_SERVER = b"containerd-shim-podvm-v2\0forkserver\0"
"""The command line's start of a shim's fork server (shim/contract/forkserver.py): a warm
parent the daemons fork from, which uses its tree but serves no pod."""
WORKER_PARENT = (b"\0shim.network.worker\0", b"\0--parent\0")
"""What the command line of a fork server's worker parent holds, and of each network
worker it forks (shim/contract/workerparent.py): the server's part, as a forked worker
serves a daemon whose own use of the tree keeps it."""


def _server_part(cmdline: bytes) -> bool:
    """A fork server, its worker parent, or a worker that parent forked."""
    return cmdline.startswith(FORK_SERVER) or all(m in cmdline for m in WORKER_PARENT)


def _stop_fork_servers(pids: set[int], wait: float = 5.0) -> bool:
    """Whether nothing uses a tree whose users are `pids`: none, or only fork servers
    (and their worker parents), stopped now (SIGTERM: each removes its socket; its next
    `start` spawns another)."""
    cmdlines = {pid: _cmdline(pid) for pid in pids}
    if not all(_server_part(c) for c in cmdlines.values() if c is not None):  # None: gone
        return False
    # SIGTERM first (it removes its socket); SIGKILL for one that has not gone within
    # half the wait: a server loads at SCHED_IDLE, and on a busy node its handler may not
    # run for long. It holds no pod; a socket it leaves is replaced by the next `start`.
    # A worker parent is waited for no more than its server, which kills it.
    servers = {pid for pid, c in cmdlines.items() if (c or b"").startswith(FORK_SERVER)}
    for signum, share in ((signal.SIGTERM, 0.5), (signal.SIGKILL, 0.5)):
        for pid in pids:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait * share
        while any(alive(pid) for pid in servers):
            if time.monotonic() > deadline:
                break
            time.sleep(0.02)
        else:
            return True
    return False


def alive(pid: int) -> bool:
    """The process runs (neither gone nor a zombie)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return False


def _seen_as(host: str, names: list[str]) -> dict[str, list[str]]:
    """Each tree's paths as its processes may see it (collect)."""
    prefix = host + trees.PREFIX
    return {n: [f"{trees.PREFIX}/{n}"] + ([f"{prefix}/{n}"] if host else []) for n in names}


def _only_our_children_use(host: str) -> bool:
    """Every process still using a tree left under the host's /opt/podvm is a child of
    this one (a daemon's QEMU or virtiofsd on its way out) or a fork server (which
    collect() stops once it is a tree's only user), and there is one."""
    seen_as = _seen_as(host, trees.names(host + trees.PREFIX))
    pids = {pid for pids in users([p for paths in seen_as.values() for p in paths],
                                  os.getpid()).values() for pid in pids}
    me = os.getpid()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        if parent != me and not _server_part(_cmdline(pid) or b""):
            return False
    return bool(pids)


def _cmdline(pid: int) -> bytes | None:
    """The process's command line; None when it is gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return None


def lock(host: str = "") -> int | None:
    """The note's lock (trees.RETIRED), held until the fd is closed or the process ends:
    one collection after an uninstall at a time. None: no note."""
    try:
        fd = os.open(os.path.join(host + trees.PREFIX, trees.RETIRED),
                     os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def collect_retired(host: str = "", wait: float = 0) -> list[str]:
    """After an uninstall that left trees in use (trees.RETIRED): the trees no other
    process uses now, and once none is left, `current`, the links and directories the
    note names (what install made), the note. Run by a shim's daemon as it exits; one at
    a time (the lock stays held until the caller exits, so the next sees it gone).
    `wait`: seconds to go on trying while the only processes still using a tree are the
    caller's own children (the daemon's QEMU and virtiofsd, exiting): the last pod's
    daemon is the last collector, nothing comes after it."""
    fd = lock(host)
    if fd is None:
        return []
    prefix = host + trees.PREFIX
    deadline = time.monotonic() + wait
    removed = collect(host, keep_current=False, exclude=os.getpid())
    while trees.names(prefix) and time.monotonic() < deadline and \
            _only_our_children_use(host):
        time.sleep(0.1)
        removed += collect(host, keep_current=False, exclude=os.getpid())
    if not trees.names(prefix):
        with open(fd, closefd=False) as f:
            f.seek(0)
            finish(host, [line.strip() for line in f.read().splitlines() if line.strip()])
    return removed


def finish(host: str, note: list[str]) -> None:
    """No tree is left: `current`, the note, the links it names, then its directories
    (children first; only empty ones)."""
    prefix = host + trees.PREFIX
    for path in (os.path.join(prefix, trees.RETIRED), os.path.join(prefix, trees.CURRENT),
                 *(host + p for p in note)):
        if os.path.islink(path) or path.endswith(trees.RETIRED):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
    for path in reversed(note):
        try:
            os.rmdir(host + path)
        except OSError:
            pass


OWN_CHILDREN_WAIT = 10.0
"""How long a daemon's last collection waits for its own QEMU and virtiofsd to be gone."""


def collect_retired_own() -> None:
    """collect_retired for a shim run from an installed tree, as its pod's last process
    exits (the daemon on its way out; `delete`, which containerd runs once the daemon is
    gone or kills it, last): errors said on stderr, never raised."""
    if trees.own() is None:
        return
    try:
        collect_retired(wait=OWN_CHILDREN_WAIT)
    except OSError as exc:
        sys.stderr.write(f"podvm: collecting the trees an uninstall left: {exc}\n")
