"""Cgroups paths as containerd hands them over, in both syntaxes, turned into the one form
the rest of the package works with: an absolute cgroupfs path inside a hierarchy.

cgroupfs syntax is the path itself (`/kubepods/burstable/pod<uid>/<id>`). systemd syntax is
`<slice>:<prefix>:<name>` (`kubepods-burstable-pod<uid>.slice:cri-containerd:<id>`); without
a systemd to ask, it is mapped to the directories systemd itself would create, where every
dash in a slice name is one level of nesting. Pure functions: no I/O."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from .errors import CgroupPathError

Syntax = Literal["cgroupfs", "systemd"]

SLICE_SUFFIX = ".slice"
SCOPE_SUFFIX = ".scope"
ROOT_SLICE = "-.slice"
DEFAULT_SLICE = "system.slice"
"""What runc and systemd use when the slice part is empty."""

# systemd's unit name alphabet (":" is our field separator, so it is left out here).
_UNIT_CHARS = re.compile(r"[A-Za-z0-9_.@\\-]+")
_MAX_NAME = 255


@dataclass(frozen=True)
class CgroupPath:
    """A container's cgroup, as an absolute cgroupfs path in any hierarchy."""

    path: str
    syntax: Syntax

    @property
    def parent(self) -> str:
        """The pod cgroup when this is a pod's sandbox container."""
        head = self.path.rsplit("/", 1)[0]
        return head or "/"

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[1]


def parse_cgroups_path(value: str) -> CgroupPath:
    """Either syntax: an absolute path is cgroupfs, `slice:prefix:name` is systemd."""
    if not isinstance(value, str) or not value:
        raise CgroupPathError("empty cgroups path")
    if value.startswith("/"):
        return parse_cgroupfs_path(value)
    if value.count(":") == 2:
        return parse_systemd_path(value)
    raise CgroupPathError(
        f"cgroups path {value!r} is neither an absolute cgroupfs path (/kubepods/...) nor "
        f"systemd's slice:prefix:name")


def parse_cgroupfs_path(value: str) -> CgroupPath:
    """Only canonical absolute paths: a `..` or an empty component would let a pod's path
    name a cgroup outside the one kubelet made for it."""
    if not value.startswith("/"):
        raise CgroupPathError(f"cgroupfs path {value!r} must be absolute")
    parts = value[1:].split("/")
    if parts == [""]:
        raise CgroupPathError(f"cgroupfs path {value!r} names the root, not a container's "
                              f"cgroup")
    for part in parts:
        check_component(part, value)
    return CgroupPath(path=value, syntax="cgroupfs")


def check_component(part: str, whole: str) -> None:
    """One directory name of a cgroupfs path."""
    if part in ("", ".", ".."):
        raise CgroupPathError(f"cgroups path {whole!r} has an empty, '.' or '..' component")
    if len(part.encode()) > _MAX_NAME:
        raise CgroupPathError(f"cgroups path {whole!r}: component longer than {_MAX_NAME} "
                              f"bytes")
    if any(ord(c) < 0x20 or c == "\x7f" or c == "/" for c in part):
        raise CgroupPathError(f"cgroups path {whole!r} has a control character in "
                              f"{part!r}")


def parse_systemd_path(value: str) -> CgroupPath:
    fields = value.split(":")
    if len(fields) != 3:
        raise CgroupPathError(f"systemd cgroups path {value!r} must be slice:prefix:name")
    slice_name, prefix, name = fields
    for label, part in (("slice", slice_name), ("prefix", prefix), ("name", name)):
        if part and not _UNIT_CHARS.fullmatch(part):
            raise CgroupPathError(f"systemd cgroups path {value!r}: {label} {part!r} has "
                                  f"characters systemd does not allow in a unit name")
    parent = expand_slice(slice_name or DEFAULT_SLICE, value)
    unit = unit_name(prefix, name, value)
    path = f"{parent.rstrip('/')}/{unit}"
    for part in path[1:].split("/"):
        check_component(part, value)
    return CgroupPath(path=path, syntax="systemd")


def expand_slice(slice_name: str, whole: str | None = None) -> str:
    """`a-b-c.slice` lives in `/a.slice/a-b.slice/a-b-c.slice`: systemd nests a slice in the
    slice named by its name up to the last dash."""
    context = whole if whole is not None else slice_name
    if not slice_name.endswith(SLICE_SUFFIX) or len(slice_name) == len(SLICE_SUFFIX):
        raise CgroupPathError(f"systemd cgroups path {context!r}: {slice_name!r} is not a "
                              f"slice (name.slice)")
    if "/" in slice_name:
        raise CgroupPathError(f"systemd cgroups path {context!r}: slice {slice_name!r} "
                              f"contains '/'")
    if slice_name == ROOT_SLICE:
        return "/"
    stem = slice_name[: -len(SLICE_SUFFIX)]
    words = stem.split("-")
    if "" in words:
        raise CgroupPathError(f"systemd cgroups path {context!r}: slice {slice_name!r} has an "
                              f"empty level (a leading, trailing or doubled '-')")
    levels = ["-".join(words[: i + 1]) + SLICE_SUFFIX for i in range(len(words))]
    return "/" + "/".join(levels)


def unit_name(prefix: str, name: str, whole: str) -> str:
    """A container is the scope `<prefix>-<name>.scope`; a name that is already a slice
    stands for itself."""
    if not name:
        raise CgroupPathError(f"systemd cgroups path {whole!r} has an empty name")
    if name.endswith(SLICE_SUFFIX):
        return name
    if not prefix:
        raise CgroupPathError(f"systemd cgroups path {whole!r} has an empty prefix")
    return f"{prefix}-{name}{SCOPE_SUFFIX}"
