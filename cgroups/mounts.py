"""Which cgroup hierarchies this host has and where, read from mountinfo rather than
assumed: v1 controllers may be co-mounted (`cpu,cpuacct`) or mounted anywhere, and a
hybrid host has both versions."""
from __future__ import annotations

import os
from dataclasses import dataclass

from .errors import CgroupPathError

MOUNTINFO = "/proc/self/mountinfo"
PROC_CGROUPS = "/proc/cgroups"


@dataclass(frozen=True)
class Hierarchy:
    """One mounted cgroup hierarchy; `root` is the hierarchy path the mount shows (not
    '/' inside a container that was given a subtree)."""

    mountpoint: str
    root: str
    controllers: frozenset[str]
    version: int

    def directory(self, cgroup: str) -> str:
        """The directory of a hierarchy path (as /proc/<pid>/cgroup prints it)."""
        rel = _relative(cgroup, self.root)
        if rel is None:
            raise CgroupPathError(f"cgroup {cgroup} is outside what {self.mountpoint} shows "
                                  f"(mounted from {self.root})")
        return os.path.join(self.mountpoint, rel) if rel else self.mountpoint

    def shows(self, cgroup: str) -> bool:
        return _relative(cgroup, self.root) is not None

    def below_root(self, cgroup: str) -> bool:
        """Strictly inside what this mount shows (so it is a directory we may create)."""
        rel = _relative(cgroup, self.root)
        return bool(rel)

    def to_state(self) -> dict:
        return {"mountpoint": self.mountpoint, "root": self.root,
                "controllers": sorted(self.controllers), "version": self.version}

    @classmethod
    def from_state(cls, state: dict) -> Hierarchy:
        return cls(mountpoint=state["mountpoint"], root=state["root"],
                   controllers=frozenset(state["controllers"]), version=int(state["version"]))


def _relative(path: str, root: str) -> str | None:
    if root == "/":
        return path.lstrip("/")
    if path == root:
        return ""
    if path.startswith(root.rstrip("/") + "/"):
        return path[len(root.rstrip("/")) + 1:]
    return None


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash as octal escapes."""
    out, i = [], 0
    while i < len(field):
        code = field[i + 1:i + 4]
        if field[i] == "\\" and len(code) == 3 and all(c in "01234567" for c in code):
            out.append(chr(int(code, 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def parse_mountinfo(text: str, known_controllers: frozenset[str]) -> list[Hierarchy]:
    """Every cgroup and cgroup2 mount, first mount of a hierarchy first."""
    found: list[Hierarchy] = []
    seen: set[tuple[str, str]] = set()
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        fstype, superopts = tail[0], tail[2]
        root, mountpoint = _unescape(fields[3]), _unescape(fields[4])
        if fstype == "cgroup2":
            key = ("cgroup2", "")
            version, controllers = 2, frozenset[str]()
        elif fstype == "cgroup":
            opts = superopts.split(",")
            controllers = frozenset(o for o in opts if o in known_controllers)
            named = sorted(o for o in opts if o.startswith("name="))
            if not controllers and not named:
                continue
            key = ("cgroup", ",".join(sorted(controllers) + named))
            version = 1
        else:
            continue
        if key in seen:
            continue
        seen.add(key)
        found.append(Hierarchy(mountpoint=mountpoint, root=root, controllers=controllers,
                               version=version))
    return found


def known_controllers(path: str = PROC_CGROUPS) -> frozenset[str]:
    """Controller names the kernel has (enabled ones only)."""
    names = set()
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("#"):
                    continue
                parts = line.split()
                if len(parts) >= 4 and parts[3] == "1":
                    names.add(parts[0])
    except FileNotFoundError:
        pass
    return frozenset(names)


def host_hierarchies(mountinfo: str = MOUNTINFO,
                     proc_cgroups: str = PROC_CGROUPS) -> list[Hierarchy]:
    with open(mountinfo) as f:
        text = f.read()
    return parse_mountinfo(text, known_controllers(proc_cgroups))
