"""Which code a process runs, as a name: the fork server's socket carries it, so that a
`start` only ever gets a daemon of its own code (issue 46's rule: never a mixed process).

In an install tree (podvm_core/trees.py) the tree's name is the identity: a tree is never
changed in place, an upgrade is a new tree. Outside one (a checkout, `make install`'s
virtualenv) it is a hash of the interpreter's path and of every source file of the shim's
packages as the file system has them (path, size, modification time): any edit or
reinstall is another identity. Standard library only: `start` computes it."""
from __future__ import annotations

import os
import sys

from podvm_core import trees

from ..host.paths import sha256

_PACKAGES = ("shim", "podvm_core")


def own() -> str:
    """This process's code identity: `tree-<name>` or `src-<hash>`."""
    tree = trees.own()
    if tree is not None:
        return "tree-" + os.path.basename(tree)
    return "src-" + source_hash()


def source_hash() -> str:
    """The hash of this process's interpreter and package sources (about 0.6 ms)."""
    digest = sha256(os.path.realpath(sys.executable).encode())
    for package in _PACKAGES:
        root = os.path.dirname(os.path.abspath(sys.modules[package].__file__ or ""))
        digest.update(b"\0" + root.encode())
        for path, size, mtime in sorted(_sources(root)):
            digest.update(f"\0{path}\0{size}\0{mtime}".encode())
    return digest.hexdigest()[:20]


def _sources(root: str) -> list[tuple[str, int, int]]:
    found = []
    stack = [root]
    while stack:
        directory = stack.pop()
        with os.scandir(directory) as entries:
            for entry in entries:
                if entry.name == "__pycache__":
                    continue
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
                elif entry.name.endswith(".py"):
                    st = entry.stat(follow_symlinks=False)
                    found.append((entry.path[len(root):], st.st_size, st.st_mtime_ns))
    return found


def current(identity: str) -> bool:
    """Whether `identity` is still what a new `start` would run: its tree is `current`
    (after an upgrade moves the link, the old tree's server must go, so that the tree
    collector can remove the tree), or its sources are unchanged."""
    if identity.startswith("tree-"):
        now = trees.tree_of(os.path.join(trees.PREFIX, trees.CURRENT))
        return now is not None and "tree-" + os.path.basename(now) == identity
    return "src-" + source_hash() == identity


_NAMESPACES = ("mnt", "net", "pid", "ipc", "uts", "user", "cgroup")
_STATUS = (b"Umask", b"Uid", b"Gid", b"Groups", b"NoNewPrivs", b"Seccomp", b"CapInh",
           b"CapPrm", b"CapEff", b"CapBnd", b"CapAmb")


def place(pid: int | str = "self") -> dict[str, bytes]:
    """Where a process lives and what it may do, as a daemon inherits it from whoever
    forks it: namespaces, cgroups, credentials, capabilities, limits, umask, OOM score,
    priority and scheduling class. A fork server serves only `start`s of its own place
    (forkserver.py), and its name carries the place's hash (name)."""
    found: dict[str, bytes] = {}
    for ns in _NAMESPACES:
        try:
            found["ns/" + ns] = os.readlink(f"/proc/{pid}/ns/{ns}").encode()
        except OSError:
            found["ns/" + ns] = b""
    for entry in ("cgroup", "limits", "oom_score_adj", "status"):
        try:
            with open(f"/proc/{pid}/{entry}", "rb") as f:
                found[entry] = f.read()
        except OSError:
            found[entry] = b""
    found["status"] = b"\n".join(line for line in found["status"].splitlines()
                                  if line.split(b":", 1)[0] in _STATUS)
    number = 0 if pid == "self" else int(pid)
    try:
        found["priority"] = f"{os.getpriority(os.PRIO_PROCESS, number)} " \
                            f"{os.sched_getscheduler(number)}".encode()
    except OSError:
        found["priority"] = b""
    return found


def name(code: str, where: dict[str, bytes]) -> str:
    """A fork server's name: its code and its place."""
    digest = sha256()
    for key in sorted(where):
        digest.update(key.encode() + b"\0" + where[key] + b"\0")
    return f"{code}-{digest.hexdigest()[:12]}"


def own_name() -> str:
    """This process's fork server's name: its code and its place."""
    return name(own(), place())
