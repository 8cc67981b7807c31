"""The pod's ephemeral storage as podvm-webhook writes it on the Pod (issue 44): one JSON
annotation with each container's ephemeral-storage limit, each disk-medium emptyDir's
sizeLimit, and the names of those with no number. The shim sizes the scratch disk from it
and the guest bounds each container and emptyDir inside it."""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from .model import PlanError

ANNOTATION = "storage.podvm.io/limits"
_KEYS = ("containers", "emptyDirs", "unbounded")
_KINDS = ("container", "emptyDir")


@dataclass(frozen=True)
class StorageRequest:
    containers: Mapping[str, int]
    """Container name -> its ephemeral-storage limit, bytes."""
    empty_dirs: Mapping[str, int]
    """emptyDir volume name -> its sizeLimit, bytes (disk medium only)."""
    unbounded: tuple[str, ...]
    """"container:<name>" / "emptyDir:<name>" for those with no number."""


def storage_request(annotations: Mapping[str, str]) -> StorageRequest | None:
    """None when the annotation is absent; PlanError naming the annotation on a malformed
    value (not JSON, negative, non-integer, unknown key)."""
    raw = annotations.get(ANNOTATION)
    if raw is None:
        return None
    try:
        value = json.loads(raw)
    except ValueError as e:
        raise PlanError(f"annotation {ANNOTATION} is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise PlanError(f"annotation {ANNOTATION} must be a JSON object, not "
                        f"{type(value).__name__}")
    unknown = sorted(set(value) - set(_KEYS))
    if unknown:
        raise PlanError(f"annotation {ANNOTATION} has unknown keys {unknown} (it takes "
                        f"{', '.join(_KEYS)})")
    containers = _sizes(value.get("containers", {}), "containers")
    empty_dirs = _sizes(value.get("emptyDirs", {}), "emptyDirs")
    unbounded = _unbounded(value.get("unbounded", []))
    both = [f"container:{n}" for n in containers if f"container:{n}" in unbounded] + \
        [f"emptyDir:{n}" for n in empty_dirs if f"emptyDir:{n}" in unbounded]
    if both:
        raise PlanError(f"annotation {ANNOTATION} lists {both} both with a size and as "
                        f"unbounded")
    return StorageRequest(containers=MappingProxyType(containers),
                          empty_dirs=MappingProxyType(empty_dirs), unbounded=unbounded)


def _sizes(value: object, key: str) -> dict[str, int]:
    if not isinstance(value, dict):
        raise PlanError(f"annotation {ANNOTATION}: {key} must be an object of name: bytes")
    sizes: dict[str, int] = {}
    for name, size in value.items():
        if not name:
            raise PlanError(f"annotation {ANNOTATION}: {key} has an empty name")
        # bool is an int in Python; JSON true is not a size.
        if not isinstance(size, int) or isinstance(size, bool):
            raise PlanError(f"annotation {ANNOTATION}: {key}[{name!r}]={size!r} is not an "
                            f"integer number of bytes")
        if size < 0:
            raise PlanError(f"annotation {ANNOTATION}: {key}[{name!r}]={size} is negative")
        sizes[name] = size
    return sizes


def _unbounded(value: object) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise PlanError(f"annotation {ANNOTATION}: unbounded must be a list of "
                        f"\"container:<name>\" / \"emptyDir:<name>\"")
    out: list[str] = []
    for item in value:
        kind, sep, name = item.partition(":") if isinstance(item, str) else ("", "", "")
        if not sep or kind not in _KINDS or not name:
            raise PlanError(f"annotation {ANNOTATION}: unbounded entry {item!r} is not "
                            f"\"container:<name>\" or \"emptyDir:<name>\"")
        if item not in out:
            out.append(item)
    return tuple(out)


def without_empty_dirs(request: StorageRequest) -> StorageRequest:
    """`request` less its emptyDirs (kept on the host: disable_guest_empty_dir)."""
    return StorageRequest(containers=request.containers, empty_dirs=MappingProxyType({}),
                          unbounded=tuple(u for u in request.unbounded
                                          if not u.startswith("emptyDir:")))


def encode(request: StorageRequest) -> str:
    """The annotation's value for `request` (what podvm-webhook writes)."""
    return json.dumps({"containers": dict(request.containers),
                       "emptyDirs": dict(request.empty_dirs),
                       "unbounded": list(request.unbounded)}, sort_keys=True,
                      separators=(",", ":"))


MIB = 1 << 20
BLANK_MIB = 128
"""The blank file system every scratch disk starts as (shim/vm/scratchdisk.py), one size
for every pod, so that templates do not differ by disk: a pod's disk is grown to its size
once its guest is up."""
EXT4_METADATA_PERCENT = 2
"""ext4's own share of the disk as podvm makes it (4 KiB blocks, 256-byte inodes, one per
16 KiB, no journal): inode tables 1.56%, bitmaps and group descriptors; measured free
blocks are 98.1-98.3% of the disk from 256 MiB to 10 GiB (docs/design.md)."""
EXT4_FIXED_MIB = 16
"""Room for directories, overlay work dirs and extent blocks beyond the percentage."""


def scratch_disk_mib(request: StorageRequest | None, default_mib: int,
                     base_mib: int) -> tuple[int, str]:
    """The pod's scratch disk in MiB, and why: what its containers and disk emptyDirs
    may hold (their limits) plus ext4's own overhead, plus the `default_mib` disk once,
    shared, where any of them has none; `default_mib` alone without the annotation
    (the configured disk, as it always was). Never less than the blank file system every
    disk starts as (`base_mib`)."""
    if request is None:
        disk = default_mib
        why = f"scratch disk {default_mib} MiB: no {ANNOTATION} annotation, scratch_disk_mib"
        return max(disk, base_mib), why
    given = sum(request.containers.values()) + sum(request.empty_dirs.values())
    data_mib = -(-given // MIB)
    disk = -(-data_mib * (100 + EXT4_METADATA_PERCENT) // 100) + EXT4_FIXED_MIB
    why = (f"limits {data_mib} MiB ({len(request.containers)} containers, "
           f"{len(request.empty_dirs)} emptyDirs) + {EXT4_METADATA_PERCENT}% + "
           f"{EXT4_FIXED_MIB} MiB for ext4")
    if request.unbounded:
        disk += default_mib
        why += (f" + scratch_disk_mib {default_mib} MiB shared by "
                f"{', '.join(request.unbounded)} (no limit)")
    if disk < base_mib:
        why += f" = {disk} MiB, raised to the blank file system's {base_mib} MiB"
    return max(disk, base_mib), f"scratch disk {max(disk, base_mib)} MiB = {why}"
