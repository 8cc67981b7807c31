"""What the kernel reports about a sandbox: each thread's cgroups and the limits as read
back from the files, for tests and for `podvmctl status`."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping


@dataclass(frozen=True)
class ThreadReport:
    pid: int
    tid: int
    name: str
    """The thread's comm (`CPU 0/KVM`, `qemu-system-x86`, `IO iothread0`...)."""
    role: str | None
    """The role the thread was placed with; None for one this object did not place."""
    cgroups: Mapping[str, str]
    """Controller (`unified` on cgroup v2) -> cgroup path, for the hierarchies the sandbox
    uses, as /proc/<pid>/task/<tid>/cgroup says."""
    location: str
    """`vcpus`, `vmm`, `sandbox` (not sorted yet), `mixed` (v1: sorted in some
    hierarchies only) or `outside`."""


@dataclass(frozen=True)
class LimitsReport:
    """Values read from the sandbox cgroup's files; None where the controller is absent or
    the value is unlimited (see `controllers` on the report to tell which)."""

    cpu_quota_us: int | None = None
    cpu_period_us: int | None = None
    cpu_shares: int | None = None
    """cgroup v1 cpu.shares."""
    cpu_weight: int | None = None
    """cgroup v2 cpu.weight."""
    memory_limit_bytes: int | None = None
    pids_limit: int | None = None
    cpuset_cpus: str | None = None
    """The sandbox cgroup's own cpuset.cpus (v2: None when it inherits its parent's)."""
    cpuset_mems: str | None = None
    devices: tuple[str, ...] | None = None
    """cgroup v1 devices.list lines."""


@dataclass(frozen=True)
class SandboxReport:
    version: int
    sandbox: str
    """The sandbox cgroup's path inside its hierarchies."""
    controllers: frozenset[str]
    threads: tuple[ThreadReport, ...]
    limits: LimitsReport
    files: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    """Directory -> file -> content, for every limit file of the sandbox and its children."""
