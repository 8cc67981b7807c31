"""What admission does with a pod: the shim's own plan (PodPlanner, the configuration
file the nodes use) from the inputs kubelet will give the node, then the rules of the
mode the configuration sets.

- A pod of another runtime class: allowed, untouched.
- Either mode: refused when the shim would refuse it on the node (a sizing annotation
  `enable_annotations` does not allow, a VM larger than the maxima, a pod cgroup smaller
  than the VM and its QEMU).
- static (`static_sandbox_resource_mgmt`): the VM is sized once, from the limits. Refused:
  requests different from limits, a container without a memory limit, a declared
  overhead smaller than the plan's. Admitted pods get the sizing annotations the plan was
  computed with (those `enable_annotations` allows and the user did not set), so the node
  boots the same VM whatever its own defaults, and `podvm.io/vm`: that VM's size.
- dynamic: no sizing annotation; a warning when the declared overhead differs from the plan's.
- Either mode, admitted: `storage.podvm.io/limits` (shim/resources/storage.py), the pod's
  ephemeral-storage limits and disk emptyDirs' sizeLimits, which size its scratch disk on
  the node (kubelet does not pass them through the CRI); one the user set is kept, and
  refused when malformed. The plan's explanation says what has no limit (it shares the
  default).

Pure: no I/O, no HTTP; `podvmctl plan` and the server share it."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from fractions import Fraction

from shim.config import Config
from shim.resources.planner import PodPlanner, pod_cgroup_memory_mib
from shim.resources import Host, PlanError, SandboxPlan
from shim.resources.annotations import KATA
from shim.resources.model import MIB
from shim.resources import storage
from shim.resources.podspec import (RESOURCES, ContainerSpec, PodSpec, pod_cgroup, pod_storage,
                                    read_pod, sandbox_resources)
from shim.resources.quantity import ceil_milli, ceil_value

ANY_NODE = Host(cpus=1 << 20, memory_mib=1 << 40)
"""The node is not chosen at admission: a maximum the configuration leaves to the node's
size (0) is checked by the shim there, not here."""
SIZING_ANNOTATIONS = ("default_vcpus", "default_memory")
VM_ANNOTATION = "podvm.io/vm"
"""Static mode: the VM the node will boot, for people and tools (`kubectl describe`)."""
BAD_REQUEST, FORBIDDEN = 400, 403


@dataclass(frozen=True)
class Verdict:
    podvm: bool
    """The pod runs on a podvm runtime class (else it is allowed untouched)."""
    allowed: bool
    code: int = 200
    """The HTTP-style status of a refusal: 400 a pod that cannot be read, 403 a policy."""
    reasons: tuple[str, ...] = ()
    """Why it is refused, each with its fix."""
    annotations: dict[str, str] = field(default_factory=dict)
    """To add to the pod (static mode)."""
    warnings: tuple[str, ...] = ()
    plan: SandboxPlan | None = None
    mode: str = ""
    explanation: tuple[str, ...] = ()

    @property
    def message(self) -> str:
        return "; ".join(self.reasons)


@dataclass(frozen=True)
class Policy:
    config: Config
    runtime_classes: frozenset[str] = frozenset({"podvm"})

    @property
    def static(self) -> bool:
        return self.config.runtime.static_sandbox_resource_mgmt


def runtime_class_of(obj: object) -> str:
    """spec.runtimeClassName, read without judging the rest (the cost for other pods)."""
    spec = obj.get("spec") if isinstance(obj, dict) else None
    value = spec.get("runtimeClassName") if isinstance(spec, dict) else None
    return value if isinstance(value, str) else ""


def admit(obj: object, policy: Policy) -> Verdict:
    if runtime_class_of(obj) not in policy.runtime_classes:
        return Verdict(podvm=False, allowed=True)
    mode = "static" if policy.static else "dynamic"
    try:
        pod = read_pod(obj)
    except ValueError as exc:
        return Verdict(podvm=True, allowed=False, code=BAD_REQUEST, mode=mode,
                       reasons=(f"the pod cannot be sized: {exc}",))
    reasons = list(_static_problems(pod)) if policy.static else []
    added = _storage_annotation(pod)
    plan = None
    try:
        plan = _plan(pod, policy.config, {**pod.annotations, **added})
    except PlanError as exc:
        reasons.append(str(exc))
    explanation = (f"runtime class {pod.runtime_class}, {mode} mode "
                   f"(configuration {policy.config.source})",
                   "the node is not chosen yet: a maximum left to the node's size (0) is "
                   "checked by the shim on the node") + (plan.explanation if plan else ())
    if plan is None:
        return Verdict(podvm=True, allowed=False, code=FORBIDDEN, reasons=tuple(reasons),
                       mode=mode, explanation=explanation)
    overhead = _overhead_difference(pod, plan)
    if policy.static and overhead and overhead[0]:
        reasons.append(overhead[1])
    if reasons:
        return Verdict(podvm=True, allowed=False, code=FORBIDDEN, reasons=tuple(reasons),
                       plan=plan, mode=mode, explanation=explanation)
    if not policy.static:
        return Verdict(podvm=True, allowed=True, plan=plan, mode=mode, explanation=explanation,
                       warnings=(overhead[1],) if overhead else (), annotations=added)
    return Verdict(podvm=True, allowed=True, plan=plan, mode=mode, explanation=explanation,
                   annotations={**_sizing_annotations(pod, policy.config),
                                VM_ANNOTATION: vm_size(plan), **added})


def _storage_annotation(pod: PodSpec) -> dict[str, str]:
    """The storage annotation to add; none where the user set one (the plan checks it)."""
    if storage.ANNOTATION in pod.annotations:
        return {}
    return {storage.ANNOTATION: storage.encode(pod_storage(pod))}


def _plan(pod: PodSpec, config: Config, annotations: dict[str, str]) -> SandboxPlan:
    """The plan the shim will make on the node, from what kubelet will give it."""
    cgroup = pod_cgroup(pod)
    planner = PodPlanner(config, annotations, sandbox_resources(pod), ANY_NODE,
                         pod_cgroup_memory_mib(cgroup.memory_bytes,
                                               cgroup.overhead_memory_bytes),
                         cgroup.cpus)
    return planner.plan()


def _static_problems(pod: PodSpec):
    for c in pod.every_container:
        for resource in RESOURCES:
            request, limit = c.requests.get(resource), c.limits.get(resource)
            if limit is None and resource == "memory":
                yield (f"{_who(c)} has no limits.memory: static_sandbox_resource_mgmt sizes "
                       f"the VM once, from the containers' memory limits; set "
                       f"limits.memory" + (f" (= requests.memory, {_show('memory', request)})"
                                           if request is not None else ""))
            elif limit is None and request is not None:
                yield (f"{_who(c)} requests.cpu {_show('cpu', request)} without limits.cpu: "
                       f"the VM is sized from limits, the scheduler reserves requests; set "
                       f"limits.cpu = requests.cpu")
            elif limit is not None and request != limit:
                yield (f"{_who(c)} requests.{resource} {_show(resource, request)} != "
                       f"limits.{resource} {_show(resource, limit)}: the VM is sized from "
                       f"limits, the scheduler reserves requests; set requests.{resource} "
                       f"= limits.{resource}")


def _overhead_difference(pod: PodSpec, plan: SandboxPlan) -> tuple[bool, str] | None:
    """None when spec.overhead is the plan's; else (too small, what to declare)."""
    memory = pod.overhead.get("memory", Fraction(0))
    cpu = pod.overhead.get("cpu", Fraction(0))
    need_memory, need_cpu = plan.overhead_memory_mib * MIB, plan.overhead_cpu_millis
    if ceil_value(memory) == need_memory and ceil_milli(cpu) == need_cpu:
        return None
    small = ceil_value(memory) < need_memory or ceil_milli(cpu) < need_cpu
    declared = (f"memory {_show('memory', memory)}, cpu {_show('cpu', cpu)}"
                if pod.overhead else "none")
    return small, (f"spec.overhead (RuntimeClass {pod.runtime_class}'s overhead.podFixed) "
                   f"is {declared} but the VM takes memory {plan.overhead_memory_mib}Mi, cpu "
                   f"{need_cpu}m beyond the containers' limits: set the RuntimeClass's "
                   f"overhead.podFixed to memory: {plan.overhead_memory_mib}Mi, cpu: "
                   f"{need_cpu}m")


def _sizing_annotations(pod: PodSpec, config: Config) -> dict[str, str]:
    values = {"default_vcpus": config.qemu.default_vcpus,
              "default_memory": config.qemu.default_memory}
    return {KATA + name: str(values[name]) for name in SIZING_ANNOTATIONS
            if name in config.qemu.enable_annotations and KATA + name not in pod.annotations}


def vm_size(plan: SandboxPlan) -> str:
    return json.dumps({"vcpus": plan.vcpus, "memoryMiB": plan.memory_mib},
                      separators=(",", ":"))


def _who(c: ContainerSpec) -> str:
    return f"{c.where} ({c.name})"


def _show(resource: str, amount: Fraction | None) -> str:
    if amount is None:
        return "unset"
    if resource == "cpu":
        return f"{ceil_milli(amount)}m"
    size = ceil_value(amount)
    return f"{size // MIB}Mi" if size and size % MIB == 0 else f"{size} bytes"
