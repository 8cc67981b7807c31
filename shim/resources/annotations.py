"""The pod's totals as containerd's CRI plugin passes them on the sandbox container, and
Kata's sizing annotations, allowed only where `enable_annotations` says so."""
from __future__ import annotations

from dataclasses import replace

from .model import ContainerResources, PlanError, SandboxRequest

CRI = "io.kubernetes.cri.sandbox-"
KATA = "io.katacontainers.config.hypervisor."
_KATA_KEYS = {"default_vcpus": "default_vcpus", "default_memory": "default_memory_mib",
              "default_maxvcpus": "max_vcpus", "default_maxmemory": "max_memory_mib"}


def _int(annotations: dict[str, str], key: str) -> int:
    value = annotations.get(key, "")
    if value == "":
        return 0
    try:
        return int(value)
    except ValueError:
        raise PlanError(f"annotation {key}={value!r} is not an integer") from None


def pod_resources(annotations: dict[str, str]) -> ContainerResources:
    """io.kubernetes.cri.sandbox-cpu-quota/-period/-shares/-memory (overhead excluded)."""
    return ContainerResources(cpu_quota=_int(annotations, CRI + "cpu-quota"),
                              cpu_period=_int(annotations, CRI + "cpu-period"),
                              cpu_shares=_int(annotations, CRI + "cpu-shares"),
                              memory_limit=_int(annotations, CRI + "memory"))


def apply_kata_overrides(req: SandboxRequest, annotations: dict[str, str],
                         enabled: tuple[str, ...], source: str) -> SandboxRequest:
    """Kata's `io.katacontainers.config.hypervisor.<name>`; a disallowed one fails."""
    changes: dict[str, int] = {}
    for key in annotations:
        if not key.startswith(KATA):
            continue
        name = key[len(KATA):]
        if name not in _KATA_KEYS:
            raise PlanError(f"annotation {key} is not supported by podvm (it supports "
                            f"{', '.join(KATA + k for k in _KATA_KEYS)})")
        if name not in enabled:
            raise PlanError(f"annotation {key} is not allowed: add {name!r} to "
                            f"[hypervisor.qemu] enable_annotations in {source}")
        value = _int(annotations, key)
        if value < 0 or (value == 0 and name in ("default_vcpus", "default_memory")):
            raise PlanError(f"annotation {key}={value} must be positive")
        changes[_KATA_KEYS[name]] = value
    return replace(req, **changes)
