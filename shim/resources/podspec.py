"""A Kubernetes Pod as the cluster and the node will size it, from its manifest: each
container's CPU and memory as the API server defaults them (a limit without a request
requests the limit), the pod's effective requests and limits (init containers run one at
a time before the others: the larger of the largest one and the sum of the others;
sidecars, restartable init containers, add to both), and what kubelet gives the node
for it: CRI's sandbox resources (containerd's `io.kubernetes.cri.sandbox-*` annotations,
which size the VM) and the pod cgroup; and its ephemeral storage (each container's
`ephemeral-storage` limit, each disk emptyDir's sizeLimit), which sizes its scratch disk
(shim/resources/storage.py). Pure; ValueError names the field at fault."""
from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Callable, Mapping

from podvm_core.protocol import DEFAULT_CFS_PERIOD_US

from .model import MIN_SHARES, ContainerResources
from .quantity import ceil_milli, ceil_value, parse_quantity
from .storage import StorageRequest

RESOURCES = ("cpu", "memory")
EPHEMERAL_STORAGE = "ephemeral-storage"
MAX_SHARES = 262144
MIN_QUOTA_US = 1000

Amounts = Mapping[str, Fraction]


@dataclass(frozen=True)
class ContainerSpec:
    name: str
    where: str
    """Its field in the manifest (`spec.containers[0]`), for messages."""
    requests: Amounts
    limits: Amounts
    sidecar: bool = False
    """An init container with restartPolicy Always: it runs beside the app containers."""
    storage_limit: int | None = None
    """limits.ephemeral-storage in bytes; None when unset."""


@dataclass(frozen=True)
class PodSpec:
    name: str
    runtime_class: str
    annotations: Mapping[str, str]
    containers: tuple[ContainerSpec, ...]
    init_containers: tuple[ContainerSpec, ...] = ()
    overhead: Amounts = field(default_factory=dict)
    """spec.overhead, as the RuntimeClass admission plugin set it; {} when none."""
    empty_dirs: Mapping[str, int | None] = field(default_factory=dict)
    """The emptyDir volumes not of medium Memory: name -> sizeLimit in bytes (None: unset)."""

    @property
    def every_container(self) -> tuple[ContainerSpec, ...]:
        return self.init_containers + self.containers


def read_pod(pod: Any) -> PodSpec:
    """A Pod object (as JSON decodes it). ValueError for what the model cannot read."""
    if not isinstance(pod, dict):
        raise ValueError("the pod must be an object")
    metadata = _object(pod.get("metadata"), "metadata")
    spec = _object(pod.get("spec"), "spec")
    annotations = _object(metadata.get("annotations"), "metadata.annotations")
    if not all(isinstance(v, str) for v in annotations.values()):
        raise ValueError("metadata.annotations: every value must be a string")
    runtime_class = spec.get("runtimeClassName") or ""
    if not isinstance(runtime_class, str):
        raise ValueError("spec.runtimeClassName must be a string")
    containers = _containers(spec, "containers")
    if not containers:
        raise ValueError("spec.containers: a pod needs at least one container")
    name = metadata.get("name") or metadata.get("generateName") or ""
    return PodSpec(name=str(name), runtime_class=runtime_class, annotations=annotations,
                   containers=containers, init_containers=_containers(spec, "initContainers"),
                   overhead=_amounts(spec.get("overhead"), "spec.overhead"),
                   empty_dirs=_empty_dirs(spec))


def _empty_dirs(spec: dict) -> dict[str, int | None]:
    volumes = spec.get("volumes") or []
    if not isinstance(volumes, list):
        raise ValueError("spec.volumes must be a list")
    found: dict[str, int | None] = {}
    for i, volume in enumerate(volumes):
        volume = _object(volume, f"spec.volumes[{i}]")
        if "emptyDir" not in volume:
            continue
        where = f"spec.volumes[{i}].emptyDir"
        empty_dir = _object(volume["emptyDir"], where)
        if empty_dir.get("medium") == "Memory":  # the guest's RAM: the memory limit's
            continue
        name = volume.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"spec.volumes[{i}].name must be a non-empty string")
        found[name] = _size(empty_dir.get("sizeLimit"), f"{where}.sizeLimit")
    return found


def _size(quantity: Any, where: str) -> int | None:
    """A storage quantity in whole bytes (rounded up); None when unset."""
    if quantity is None:
        return None
    return ceil_value(_quantity(quantity, where))


def _quantity(quantity: Any, where: str) -> Fraction:
    """A Kubernetes quantity, never negative; ValueError naming `where`."""
    try:
        amount = parse_quantity(quantity)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    if amount < 0:
        raise ValueError(f"{where}: {quantity!r} must not be negative")
    return amount


def _object(value: Any, where: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be an object")
    return value


def _containers(spec: dict, key: str) -> tuple[ContainerSpec, ...]:
    items = spec.get(key) or []
    if not isinstance(items, list):
        raise ValueError(f"spec.{key} must be a list")
    found = []
    for i, item in enumerate(items):
        where = f"spec.{key}[{i}]"
        item = _object(item, where)
        resources = _object(item.get("resources"), f"{where}.resources")
        limits = _amounts(resources.get("limits"), f"{where}.resources.limits")
        requests = {**limits, **_amounts(resources.get("requests"),
                                         f"{where}.resources.requests")}
        found.append(ContainerSpec(name=str(item.get("name") or where), where=where,
                                   requests=requests, limits=limits,
                                   sidecar=key == "initContainers"
                                   and item.get("restartPolicy") == "Always",
                                   storage_limit=_size(
                                       _object(resources.get("limits"), where).get(
                                           EPHEMERAL_STORAGE),
                                       f"{where}.resources.limits.{EPHEMERAL_STORAGE}")))
    return tuple(found)


def _amounts(value: Any, where: str) -> dict[str, Fraction]:
    """CPU and memory of a resource list; other resources are not the VM's business."""
    amounts = {}
    for resource, quantity in _object(value, where).items():
        if resource not in RESOURCES:
            continue
        amounts[resource] = _quantity(quantity, f"{where}.{resource}")
    return amounts


def pod_storage(pod: PodSpec) -> StorageRequest:
    """What the pod's scratch disk must hold: every container's ephemeral-storage limit,
    init containers' too, summed (not kubelet's PodLimits, the larger of the app
    containers' sum and the largest init container: an init container's writable layer
    stays on the disk until the pod goes), and each disk emptyDir's sizeLimit; those
    with no number (or 0) are unbounded (docs/design.md, "The scratch disk's size")."""
    # 0 is no limit, as kubelet's eviction reads it
    containers = {c.name: c.storage_limit for c in pod.every_container}
    return StorageRequest(
        containers={n: v for n, v in containers.items() if v},
        empty_dirs={n: v for n, v in pod.empty_dirs.items() if v},
        unbounded=tuple([f"container:{n}" for n, v in containers.items() if not v] +
                        [f"emptyDir:{n}" for n, v in pod.empty_dirs.items() if not v]))


def pod_requests(pod: PodSpec) -> dict[str, Fraction]:
    """What the scheduler reserves for the pod's containers (overhead excluded)."""
    return _effective(pod, lambda c: c.requests)


def pod_limits(pod: PodSpec) -> dict[str, Fraction]:
    """The pod's limits (overhead excluded): a resource some container does not limit
    is summed over those that do, as kubelet sums them."""
    return _effective(pod, lambda c: c.limits)


def _effective(pod: PodSpec, of: Callable[[ContainerSpec], Amounts]) -> dict[str, Fraction]:
    total: dict[str, Fraction] = {}
    sidecars: dict[str, Fraction] = {}
    largest_init: dict[str, Fraction] = {}
    for c in pod.containers:
        _add(total, of(c))
    for c in pod.init_containers:
        if c.sidecar:
            _add(total, of(c))
            _add(sidecars, of(c))
            running = dict(sidecars)
        else:
            running = dict(of(c))
            _add(running, sidecars)
        for resource, amount in running.items():
            largest_init[resource] = max(largest_init.get(resource, Fraction(0)), amount)
    for resource, amount in largest_init.items():
        total[resource] = max(total.get(resource, Fraction(0)), amount)
    return total


def _add(into: dict[str, Fraction], amounts: Amounts) -> None:
    for resource, amount in amounts.items():
        into[resource] = into.get(resource, Fraction(0)) + amount


def sandbox_resources(pod: PodSpec) -> ContainerResources:
    """What kubelet puts in the PodSandboxConfig (containerd passes it to the shim as the
    sandbox annotations): shares from the CPU request, a CFS quota from the CPU limit,
    the memory limit; overhead excluded."""
    requests, limits = pod_requests(pod), pod_limits(pod)
    cpu_limit = ceil_milli(limits.get("cpu", Fraction(0)))
    return ContainerResources(cpu_quota=milli_cpu_to_quota(cpu_limit, DEFAULT_CFS_PERIOD_US),
                              cpu_period=DEFAULT_CFS_PERIOD_US,
                              cpu_shares=milli_cpu_to_shares(
                                  ceil_milli(requests.get("cpu", Fraction(0)))),
                              memory_limit=ceil_value(limits.get("memory", Fraction(0))))


def milli_cpu_to_shares(milli: int) -> int:
    """kubelet's MilliCPUToShares."""
    if milli == 0:
        return MIN_SHARES
    return min(MAX_SHARES, max(MIN_SHARES, milli * 1024 // 1000))


def milli_cpu_to_quota(milli: int, period: int) -> int:
    """kubelet's milliCPUToQuota: 0 = no limit; never below 1 ms."""
    if milli == 0:
        return 0
    return max(MIN_QUOTA_US, milli * period // 1000)


@dataclass(frozen=True)
class PodCgroup:
    """The pod cgroup kubelet makes: the pod's limits plus its overhead, for a resource
    every container limits; 0 = unlimited."""

    memory_bytes: int
    overhead_memory_bytes: int
    cpus: float


def pod_cgroup(pod: PodSpec) -> PodCgroup:
    limits = pod_limits(pod)
    every = pod.every_container
    memory = ceil_value(limits["memory"]) if all(
        c.limits.get("memory") for c in every) else 0
    overhead_memory = ceil_value(pod.overhead.get("memory", Fraction(0)))
    cpus = 0.0
    if all(c.limits.get("cpu") for c in every):
        milli = ceil_milli(limits["cpu"] + pod.overhead.get("cpu", Fraction(0)))
        cpus = milli_cpu_to_quota(milli, DEFAULT_CFS_PERIOD_US) / DEFAULT_CFS_PERIOD_US
    return PodCgroup(memory_bytes=memory, overhead_memory_bytes=overhead_memory, cpus=cpus)
