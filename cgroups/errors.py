"""One exception hierarchy, so callers catch `CgroupError` and users read which cgroup path
and which step failed: a half-understood cgroup error is how threads end up uncharged."""
from __future__ import annotations

import errno as errno_module
import os


class CgroupError(Exception):
    """Anything this package refuses or the kernel rejected."""


class CgroupPathError(CgroupError, ValueError):
    """A cgroups path (cgroupfs or systemd syntax) or a sandbox id that is malformed."""


class InvalidLimits(CgroupError, ValueError):
    """A limit value the kernel would reject or misread; raised before anything is written."""


class ControllerUnavailable(CgroupError):
    """A limit needs a controller this host does not give the sandbox cgroup."""

    def __init__(self, controllers: list[str], where: str, fields: list[str]) -> None:
        self.controllers = tuple(controllers)
        self.fields = tuple(fields)
        super().__init__(
            f"controller(s) {', '.join(controllers)} not available at {where}; cannot apply "
            f"{', '.join(fields)} (leave them None, or use CgroupLimits.restricted_to())")


class NoCgroupHierarchy(CgroupError):
    """Neither a cgroup2 mount nor cgroup v1 cpu and memory hierarchies were found."""


class ProcessGone(CgroupError):
    """The process whose threads were to be placed has exited."""


class NotInSandbox(CgroupError):
    """A thread cannot be sorted into vcpus/ or vmm/ before its process is in the sandbox."""


class CgroupIOError(CgroupError, OSError):
    """The kernel refused a read, write, mkdir or rmdir of a cgroup file or directory."""

    def __init__(self, action: str, path: str, err: OSError, value: str | None = None) -> None:
        self.action = action
        self.path = path
        self.value = value
        code = err.errno or 0
        name = errno_module.errorcode.get(code, str(code))
        what = f"{action} {value!r} to {path}" if value is not None else f"{action} {path}"
        super().__init__(code, f"{what}: {name} ({os.strerror(code)})")

    def __str__(self) -> str:
        return str(self.args[1])


class CgroupBusy(CgroupIOError):
    """A cgroup could not be removed because tasks are still in it."""
