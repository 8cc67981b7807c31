"""The inputs of one pod's plan, kept for the pod's life: the configuration, the sandbox's
annotations (CRI's pod totals, Kata's sizing annotations), what the pod cgroup allows,
and each container's resources. Every change (a container created, updated or removed)
re-plans from all of them with the pure model; the Pod (shim/pod/pod.py) then applies the
delta.

Both APIs build these inputs here, from what each receives (the sandbox container's OCI
spec and its pod cgroup; a PodSandboxConfig), so a pod gets the same plan whichever API
created it. The webhook (podvm_webhook/policy.py) plans with them too."""
from __future__ import annotations

import json
from dataclasses import replace
from typing import Callable, Mapping, TypeVar

from podvm_core.cpulist import format_cpu_list, parse_cpu_list

from ..config import Config
from . import annotations as annotations_model
from . import storage
from .model import (MIB, ContainerResources, Host, NoFit, PlanError, SandboxPlan,
                    from_linux_resources, plan_sandbox, request_from_config)
from .update import PlanDelta, StaticSizeExceeded, plan_update, pod_totals

T = TypeVar("T")


class PodPlanner:
    def __init__(self, config: Config, annotations: Mapping[str, str],
                 sandbox: ContainerResources, host: Host, pod_cgroup_memory_mib: int = 0,
                 pod_cgroup_cpus: float = 0.0) -> None:
        self.config = config
        self.annotations = dict(annotations)
        self.sandbox = sandbox
        """What the sandbox said for the whole pod (CRI's annotations), or for a container
        that is its own pod (ctr run), its own resources."""
        self.containers: dict[str, ContainerResources] = {}
        self.host = host
        self.pod_cgroup_memory_mib = pod_cgroup_memory_mib
        self.pod_cgroup_cpus = pod_cgroup_cpus
        self.boot: SandboxPlan | None = None
        self.exclusive: frozenset[int] | None = None
        """cpu_reservation = "exclusive": the host CPUs this pod holds for itself."""
        self.shared_pool: Callable[[], frozenset[int]] | None = None
        """cpu_reservation = "exclusive", for a pod without its own CPUs: the CPUs no pod
        holds, read at each re-plan."""

    @classmethod
    def for_sandbox(cls, config: Config, spec: dict, host: Host, pod_cgroup_memory_mib: int = 0,
                    pod_cgroup_cpus: float = 0.0) -> PodPlanner:
        """From the sandbox container's OCI spec. PlanError for a bad annotation."""
        annotations = spec.get("annotations") or {}
        if any(k.startswith(annotations_model.CRI) for k in annotations):
            pod = annotations_model.pod_resources(annotations)
        else:
            pod = resources_of(spec)
        return cls(config, annotations, pod, host, pod_cgroup_memory_mib, pod_cgroup_cpus)

    @classmethod
    def for_pod_config(cls, config: Config, pod, annotations: Mapping[str, str],
                       host: Host) -> PodPlanner:
        """From a CRI PodSandboxConfig (the Sandbox API): the pod's totals, and the pod
        cgroup kubelet makes for it, which holds the containers' limits plus the
        RuntimeClass overhead. PlanError for a bad annotation."""
        base = pod_resources(pod)
        overhead = pod.linux.overhead
        overhead_bytes = max(0, overhead.memory_limit_in_bytes)
        overhead_cpus = overhead.cpu_quota / overhead.cpu_period \
            if overhead.cpu_quota > 0 and overhead.cpu_period > 0 else 0.0
        return cls(config, annotations, base, host,
                   pod_cgroup_memory_mib(base.memory_limit, overhead_bytes),
                   base.quota_cpus + overhead_cpus if base.quota_cpus else 0.0)

    def plan(self, containers: Mapping[str, ContainerResources] | None = None,
             sandbox: ContainerResources | None = None) -> SandboxPlan:
        """The plan for these containers (default: the current ones). NoFit / PlanError."""
        pod = pod_totals(self.sandbox if sandbox is None else sandbox,
                         self.containers if containers is None else containers)
        req = request_from_config(self.config, pod)
        req = annotations_model.apply_kata_overrides(
            req, self.annotations, self.config.qemu.enable_annotations, self.config.source)
        req = replace(req, pod_cgroup_memory_mib=self.pod_cgroup_memory_mib,
                      pod_cgroup_cpus=self.pod_cgroup_cpus)
        plan = self._with_disk(plan_sandbox(req, self.host))
        cpuset = self._cpuset(plan.cpuset)
        if cpuset == plan.cpuset:
            return plan
        return replace(plan, cpuset=cpuset, explanation=plan.explanation + (
            f"cpuset {cpuset}: " + ("the pod's exclusive CPUs" if self.exclusive else
                                    "the CPUs no pod holds exclusively"),))

    def _with_disk(self, plan: SandboxPlan) -> SandboxPlan:
        """`plan` with the pod's scratch disk (none where scratch_disk_mib = 0)."""
        default = self.config.qemu.scratch_disk_mib
        if not default:
            return plan
        request = storage.storage_request(self.annotations)
        if request is not None and self.config.runtime.disable_guest_empty_dir:
            request = storage.without_empty_dirs(request)  # they are the host's
        disk, why = storage.scratch_disk_mib(request, default, storage.BLANK_MIB)
        return replace(plan, disk_mib=disk, explanation=plan.explanation + (why,))

    def _cpuset(self, union: str) -> str:
        if self.exclusive:
            return format_cpu_list(self.exclusive)
        if self.shared_pool is None:
            return union
        pool = self.shared_pool()
        if not pool:
            raise NoFit("no CPU is left for pods without exclusive CPUs: every CPU of the "
                        "node is reserved (cpu_reservation = \"exclusive\")")
        return format_cpu_list((parse_cpu_list(union) & pool) or pool)

    def exclusive_request(self) -> int:
        """The pod's CPU request (its shares / 1024) when it is whole, else 0: only whole
        CPUs are reserved exclusively."""
        cpus = self.sandbox.share_cpus
        return int(cpus) if cpus >= 1 and float(cpus).is_integer() else 0

    def update(self, current: SandboxPlan, containers: Mapping[str, ContainerResources],
               sandbox: ContainerResources | None = None) -> PlanDelta:
        """The step from the plan in force to the plan for `containers`. NoFit, PlanError,
        StaticSizeExceeded."""
        assert self.boot is not None, "the pod has not booted"
        static = self.config.runtime.static_sandbox_resource_mgmt
        try:
            wanted = self.plan(containers, sandbox)
        except NoFit as exc:
            if not static:
                raise
            raise StaticSizeExceeded(
                f"{exc}; and static_sandbox_resource_mgmt sizes the VM once at boot "
                f"({self.boot.vcpus} vCPUs, {self.boot.memory_mib} MiB): no CPU or memory "
                f"can be added") from None
        return plan_update(current, self.boot, wanted, static=static)

    def commit(self, containers: Mapping[str, ContainerResources],
               sandbox: ContainerResources | None = None) -> None:
        """The inputs whose plan is now in force."""
        self.containers = dict(containers)
        if sandbox is not None:
            self.sandbox = sandbox


def pod_cgroup_memory_mib(limit_bytes: int, overhead_bytes: int) -> int:
    """kubelet's pod cgroup memory for a pod with these limits (0: none), rounded up as
    the model rounds the workload up."""
    return -(-(limit_bytes + overhead_bytes) // MIB) if limit_bytes else 0


def pod_resources(pod) -> ContainerResources:
    """The pod's totals from a PodSandboxConfig (none set: no limits)."""
    r = pod.linux.resources
    return ContainerResources(cpu_quota=r.cpu_quota, cpu_period=r.cpu_period,
                              cpu_shares=r.cpu_shares,
                              memory_limit=max(0, r.memory_limit_in_bytes),
                              cpuset=r.cpuset_cpus)


def parse_linux_resources(raw: bytes) -> tuple[dict, ContainerResources]:
    """An OCI LinuxResources object as JSON (as Task.Update and UpdateSandbox carry it):
    the object, and what the model takes from it. ValueError saying what is wrong."""
    try:
        resources = json.loads(raw) if raw else {}
    except ValueError as exc:
        raise ValueError(f"resources are not JSON: {exc}") from None
    if not isinstance(resources, dict):
        raise ValueError("resources must be a LinuxResources object")
    try:
        return resources, from_linux_resources(resources)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"bad resources: {exc}") from None


def resources_of(spec: dict) -> ContainerResources:
    return from_linux_resources((spec.get("linux") or {}).get("resources") or {})


def planned(compute: Callable[[], T]) -> T:
    """Run a planning step. A value the model could not read (ValueError, TypeError) is
    the request's fault: it is raised as a PlanError, with its message; the model's own
    errors (PlanError, NoFit, StaticSizeExceeded) as they are."""
    try:
        return compute()
    except PlanError:
        raise
    except (ValueError, TypeError) as exc:
        raise PlanError(str(exc)) from None
