"""What the sandbox cgroup is limited to, checked whole before anything is written: a
limit half-applied (quota written, memory refused) leaves a pod bounded by numbers nobody
chose. Pure: no I/O."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Iterable

from podvm_core.cpulist import CpuListError, format_cpu_list, parse_cpu_list
from podvm_core.protocol import DEFAULT_CFS_PERIOD_US

from .errors import InvalidLimits

__all__ = ["format_cpu_list", "parse_cpu_list"]  # cgroup files use the kernel's syntax

MIN_SHARES, MAX_SHARES = 2, 262144
DEFAULT_SHARES = 1024
MIN_QUOTA_US = 1000
MIN_PERIOD_US, MAX_PERIOD_US = 1000, 1_000_000
DEFAULT_PERIOD_US = DEFAULT_CFS_PERIOD_US


def shares_to_weight(shares: int) -> int:
    """cgroup v2 has cpu.weight (1..10000) where v1 had cpu.shares (2..262144); the linear
    map runc and Kubernetes use, so a pod gets the same weight from either runtime."""
    if not MIN_SHARES <= shares <= MAX_SHARES:
        raise InvalidLimits(f"cpu shares {shares} outside {MIN_SHARES}..{MAX_SHARES}")
    return 1 + ((shares - 2) * 9999) // 262142


def or_max(value: int | None) -> str:
    """How cgroup files spell "no limit" (pids.max, memory.max, cpu.max's quota)."""
    return "max" if value is None else str(value)


@dataclass(frozen=True)
class DeviceRule:
    """One cgroup v1 devices.allow line: `c 1:3 rwm`; minor None is `*`."""

    kind: str
    major: int
    minor: int | None
    access: str = "rwm"
    name: str = ""
    """The /dev node, for people reading a report; not written anywhere."""

    def __post_init__(self) -> None:
        if self.kind not in ("c", "b"):
            raise InvalidLimits(f"device rule {self}: type must be 'c' or 'b'")
        if self.major < 0 or (self.minor is not None and self.minor < 0):
            raise InvalidLimits(f"device rule {self}: negative major or minor")
        if not self.access or set(self.access) - set("rwm"):
            raise InvalidLimits(f"device rule {self}: access must be letters of 'rwm'")

    @property
    def line(self) -> str:
        minor = "*" if self.minor is None else str(self.minor)
        return f"{self.kind} {self.major}:{minor} {self.access}"


# What QEMU opens, by the numbers Linux assigns statically (Documentation/admin-guide/
# devices.txt), so the list does not depend on which nodes this host has created.
QEMU_DEVICES: tuple[DeviceRule, ...] = (
    DeviceRule("c", 1, 3, name="/dev/null"),
    DeviceRule("c", 1, 5, name="/dev/zero"),
    DeviceRule("c", 1, 7, name="/dev/full"),
    DeviceRule("c", 1, 8, name="/dev/random"),
    DeviceRule("c", 1, 9, name="/dev/urandom"),
    DeviceRule("c", 5, 0, name="/dev/tty"),
    DeviceRule("c", 5, 2, name="/dev/ptmx"),
    DeviceRule("c", 136, None, name="/dev/pts/*"),
    DeviceRule("c", 10, 232, name="/dev/kvm"),
    DeviceRule("c", 10, 238, name="/dev/vhost-net"),
    DeviceRule("c", 10, 241, name="/dev/vhost-vsock"),
    DeviceRule("c", 10, 200, name="/dev/net/tun"),
)

CONTROLLER_OF_FIELD: dict[str, str] = {
    "cpu_quota_us": "cpu",
    "cpu_period_us": "cpu",
    "cpu_shares": "cpu",
    "memory_limit_bytes": "memory",
    "pids_limit": "pids",
    "cpuset_cpus": "cpuset",
    "vmm_cpuset_cpus": "cpuset",
    "cpuset_mems": "cpuset",
    "devices": "devices",
}


@dataclass(frozen=True)
class CgroupLimits:
    """The sandbox cgroup's limits. None leaves that dimension unlimited (or at the kernel's
    default: shares 1024, period 100 ms, the parent's cpuset, every device)."""

    cpu_quota_us: int | None = None
    cpu_period_us: int | None = None
    cpu_shares: int | None = None
    memory_limit_bytes: int | None = None
    pids_limit: int | None = None
    cpuset_cpus: str | None = None
    """The vCPUs' CPUs (vcpus/), and vmm/'s unless vmm_cpuset_cpus is set."""
    vmm_cpuset_cpus: str | None = None
    """CPUs of its own for vmm/ (QEMU's other threads: an overhead CPU set)."""
    cpuset_mems: str | None = None
    devices: tuple[DeviceRule, ...] | None = field(default=None)
    """cgroup v1 only: the allow-list (everything else denied); QEMU_DEVICES for a VM."""

    def __post_init__(self) -> None:
        for name in ("cpu_quota_us", "cpu_period_us", "cpu_shares", "memory_limit_bytes",
                     "pids_limit"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise InvalidLimits(f"{name} must be an integer or None, not {value!r}")
        q, p = self.cpu_quota_us, self.cpu_period_us
        if q is not None and q < MIN_QUOTA_US:
            raise InvalidLimits(f"cpu_quota_us {q}: at least {MIN_QUOTA_US} µs (None for no "
                                f"quota)")
        if p is not None and not MIN_PERIOD_US <= p <= MAX_PERIOD_US:
            raise InvalidLimits(f"cpu_period_us {p}: must be {MIN_PERIOD_US}..{MAX_PERIOD_US}")
        if self.cpu_shares is not None and not MIN_SHARES <= self.cpu_shares <= MAX_SHARES:
            raise InvalidLimits(f"cpu_shares {self.cpu_shares}: must be {MIN_SHARES}.."
                                f"{MAX_SHARES}")
        if self.memory_limit_bytes is not None and self.memory_limit_bytes <= 0:
            raise InvalidLimits(f"memory_limit_bytes {self.memory_limit_bytes}: must be > 0 "
                                f"(None for unlimited)")
        if self.pids_limit is not None and self.pids_limit <= 0:
            raise InvalidLimits(f"pids_limit {self.pids_limit}: must be > 0 (None for "
                                f"unlimited)")
        for name in ("cpuset_cpus", "vmm_cpuset_cpus", "cpuset_mems"):
            value = getattr(self, name)
            if value is None:
                continue
            try:
                cpus = parse_cpu_list(value, name) if isinstance(value, str) else None
            except CpuListError as exc:
                raise InvalidLimits(str(exc)) from None
            if not cpus:
                raise InvalidLimits(f"{name} {value!r}: a non-empty list like '0-3,8' (None "
                                    f"for the parent's)")
            object.__setattr__(self, name, format_cpu_list(cpus))
        if self.devices is not None:
            if not all(isinstance(rule, DeviceRule) for rule in self.devices):
                raise InvalidLimits("devices must be DeviceRule values")
            object.__setattr__(self, "devices", tuple(self.devices))

    @property
    def cpu_weight(self) -> int | None:
        return None if self.cpu_shares is None else shares_to_weight(self.cpu_shares)

    def controllers(self) -> dict[str, list[str]]:
        """Controller -> the fields set here that need it."""
        needed: dict[str, list[str]] = {}
        for name, controller in CONTROLLER_OF_FIELD.items():
            if getattr(self, name) is not None:
                needed.setdefault(controller, []).append(name)
        return needed

    def restricted_to(self, controllers: Iterable[str]) -> CgroupLimits:
        """The same limits with those this host cannot apply left unset; for callers that
        prefer running unlimited on a dimension to failing the pod."""
        have = set(controllers)
        unset = {name: None for name, c in CONTROLLER_OF_FIELD.items() if c not in have}
        return dataclasses.replace(self, **unset)
