"""The pod VM's host cgroup: where it goes (under the pod cgroup kubelet chose), the
limits the plan gives it, QEMU started inside it (docs/design.md, "Sandbox cgroup
layout"); its threads are sorted into it by role by shim/cpus/vmthreads.py.
The `cgroups` package does the kernel work; this module decides what to ask of it."""
from __future__ import annotations

import logging
import os

from google.protobuf.any_pb2 import Any

import cgroups
from cgroups import CgroupLimits, SandboxCgroup, SandboxLayout

from .podstate import CgroupState
from ..resources import SandboxPlan
from ..resources.planner import pod_cgroup_memory_mib

log = logging.getLogger("podvm.cgroup")

DEFAULT_POD_CGROUP = "/podvm"
"""Where a sandbox without a cgroupsPath (nothing chose one) gets its cgroup."""
OVERHEAD_CGROUP = "/podvm_overhead"
"""Where shims go with sandbox_cgroup_only = false: charged and visible, outside the pod."""


def layout_for(cgroups_path: str, sandbox_id: str) -> SandboxLayout:
    """From the sandbox container's `linux.cgroupsPath` (cgroupfs or systemd syntax): the
    sandbox cgroup goes next to it, under the pod cgroup that is its parent."""
    if not cgroups_path:
        return SandboxLayout(DEFAULT_POD_CGROUP, sandbox_id)
    return SandboxLayout.from_cgroups_path(cgroups_path, sandbox_id)


def limits_for(plan: SandboxPlan, version: int, overhead_cpus: str = "") -> CgroupLimits:
    """The plan's sandbox cgroup numbers in the cgroups package's terms (None: unlimited);
    `overhead_cpus`: vmm/'s own CPUs (QEMU's non-vCPU threads), else the vCPUs' set."""
    quota = plan.cgroup_cpu_quota if plan.cgroup_cpu_quota > 0 else None
    return CgroupLimits(
        vmm_cpuset_cpus=overhead_cpus or None,
        cpu_quota_us=quota,
        cpu_period_us=plan.cgroup_cpu_period if quota else None,
        cpu_shares=plan.cgroup_cpu_shares,
        memory_limit_bytes=plan.cgroup_memory_limit if plan.cgroup_memory_limit > 0 else None,
        cpuset_cpus=plan.cpuset or None,
        devices=cgroups.QEMU_DEVICES if version == 1 else None)


class HostCgroup:
    """One sandbox's cgroups on the host, plus the shim's own place."""

    def __init__(self, layout: SandboxLayout, shim_in_sandbox: bool,
                 overhead_cpus: str = "") -> None:
        self.manager = cgroups.detect()
        self.layout = layout
        self.shim_in_sandbox = shim_in_sandbox
        self.overhead_cpus = overhead_cpus
        self.overhead = None if shim_in_sandbox else SandboxLayout(OVERHEAD_CGROUP,
                                                                   layout.sandbox_id)
        self.sandbox: SandboxCgroup | None = None
        self._home = self.manager.thread_cgroups(os.getpid(), os.getpid()) or {}
        """Where the shim was before: it goes back there when the sandbox is removed, so
        that it never holds up the removal of the pod cgroup kubelet made."""

    def state(self) -> CgroupState:
        """Written to sandbox.json before anything is created."""
        return CgroupState(manager=self.manager.to_state(), layout=self.layout,
                           overhead=self.overhead)

    def create(self, plan: SandboxPlan) -> None:
        """The sandbox cgroup with the plan's limits, and the shim moved in (or into its
        overhead cgroup). All or nothing."""
        limits = limits_for(plan, self.manager.version, self.overhead_cpus)
        self.sandbox = SandboxCgroup.create(self.layout, limits, self.manager)
        try:
            if self.overhead is None:
                self.sandbox.place_process(os.getpid())
            else:
                self.manager.create(self.overhead)
                self.manager.place_process(self.overhead, os.getpid())
        except BaseException:
            self.destroy()
            raise
        log.info("sandbox cgroup %s (%s): %s; shim in %s", self.layout.sandbox,
                 self.manager.describe(), limits,
                 self.layout.sandbox if self.overhead is None else self.overhead.sandbox)

    def preexec(self):
        assert self.sandbox is not None
        return self.sandbox.preexec()

    def apply(self, plan: SandboxPlan) -> None:
        assert self.sandbox is not None
        self.sandbox.apply(limits_for(plan, self.manager.version, self.overhead_cpus))

    def vcpu_cpus(self) -> frozenset[int]:
        """The CPUs the vcpus/ cgroup allows now, as the kernel has them."""
        if isinstance(self.manager, cgroups.CgroupV2Manager):
            path = os.path.join(self.manager.hierarchy.directory(self.layout.vcpus),
                                "cpuset.cpus.effective")
        else:
            h = next(h for h in self.manager.hierarchies if "cpuset" in h.controllers)
            path = os.path.join(h.directory(self.layout.vcpus), "cpuset.cpus")
        text = _read(path)
        return cgroups.limits.parse_cpu_list(text) if text else frozenset()

    def metrics(self):
        """The sandbox cgroup's usage as containerd's cgroups Metrics (v1 or v2, as the
        host has), packed in an Any with containerd's type URL."""
        if isinstance(self.manager, cgroups.CgroupV2Manager):
            # Only the host's version, at the first SandboxMetrics (containerd 2.x only):
            # a running pod's daemon does not carry either otherwise.
            from podvm_core.pb.containerd.cgroups.v2 import metrics_pb2 as v2

            d = self.manager.hierarchy.directory(self.layout.sandbox)
            stat = dict(line.split() for line in _read(os.path.join(d, "cpu.stat"))
                        .splitlines() if len(line.split()) == 2)
            m = v2.Metrics()
            m.cpu.usage_usec = int(stat.get("usage_usec", 0))
            m.memory.usage = _int(os.path.join(d, "memory.current"))
            m.memory.usage_limit = _int(os.path.join(d, "memory.max"))
            m.pids.current = _int(os.path.join(d, "pids.current"))
            m.pids.limit = _int(os.path.join(d, "pids.max"))
            return Any(type_url="io.containerd.cgroups.v2.Metrics",
                       value=m.SerializeToString())
        from podvm_core.pb.containerd.cgroups.v1 import metrics_pb2 as v1  # as v2 above

        def path(controller: str, name: str) -> str:
            h = next(h for h in self.manager.hierarchies if controller in h.controllers)
            return os.path.join(h.directory(self.layout.sandbox), name)

        m = v1.Metrics()
        m.cpu.usage.total = _int(path("cpuacct", "cpuacct.usage"))
        m.memory.usage.usage = _int(path("memory", "memory.usage_in_bytes"))
        m.memory.usage.limit = _int(path("memory", "memory.limit_in_bytes"))
        m.memory.usage.max = _int(path("memory", "memory.max_usage_in_bytes"))
        m.pids.current = _int(path("pids", "pids.current"))
        m.pids.limit = _int(path("pids", "pids.max"))
        return Any(type_url="io.containerd.cgroups.v1.Metrics", value=m.SerializeToString())

    def destroy(self) -> None:
        """The shim goes back where it came from, any other leftover up to the pod
        cgroup; idempotent."""
        if self._home:
            try:
                self.manager.return_process(os.getpid(), self._home)
            except cgroups.CgroupError as exc:
                log.warning("shim could not return to %s: %s", self._home, exc)
        if self.sandbox is not None:
            self.sandbox.destroy()
        else:
            self.manager.destroy(self.layout)
        if self.overhead is not None:
            self.manager.destroy(self.overhead)


UNLIMITED_V1 = 1 << 62


def pod_cgroup_limits(cgroups_path: str) -> tuple[int, float]:
    """(memory MiB, CPUs) kubelet allows the pod cgroup the sandbox goes under; 0 where
    it sets no limit or the cgroup does not exist (yet)."""
    if not cgroups_path:
        return 0, 0.0
    pod = layout_for(cgroups_path, "probe").pod_cgroup
    manager = cgroups.detect()
    memory, quota, period = "", "", ""
    if isinstance(manager, cgroups.CgroupV2Manager):
        directory = manager.hierarchy.directory(pod)
        memory = _read(os.path.join(directory, "memory.max"))
        quota, _, period = _read(os.path.join(directory, "cpu.max")).partition(" ")
    else:
        for h in manager.hierarchies:
            if "memory" in h.controllers:
                memory = _read(os.path.join(h.directory(pod), "memory.limit_in_bytes"))
            if "cpu" in h.controllers:
                quota = _read(os.path.join(h.directory(pod), "cpu.cfs_quota_us"))
                period = _read(os.path.join(h.directory(pod), "cpu.cfs_period_us"))
    memory_mib = pod_cgroup_memory_mib(int(memory), 0) if memory.isdigit() and \
        int(memory) < UNLIMITED_V1 else 0
    cpus = int(quota) / int(period) if quota.isdigit() and period.isdigit() and \
        int(period) > 0 else 0.0
    return memory_mib, cpus


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _int(path: str) -> int:
    """A number from a cgroup file; 0 for "max", absent or unreadable."""
    text = _read(path)
    return int(text) if text.isdigit() else 0
