"""Host cgroups for a pod's VM: every host thread of the VM in the pod's sandbox cgroup,
vCPU threads in vcpus/, all other VMM threads in vmm/, on cgroup v1 and v2
(docs/design.md, "Sandbox cgroup layout")."""
from __future__ import annotations

from .detect import choose_manager, detect, manager_from_state
from .errors import (CgroupBusy, CgroupError, CgroupIOError, CgroupPathError,
                     ControllerUnavailable, InvalidLimits, NoCgroupHierarchy, NotInSandbox,
                     ProcessGone)
from .layout import CHILDREN, VCPUS, VMM, SandboxLayout, child_for_role
from .limits import QEMU_DEVICES, CgroupLimits, DeviceRule, shares_to_weight
from .manager import CgroupManager
from .paths import CgroupPath, parse_cgroupfs_path, parse_cgroups_path, parse_systemd_path
from .report import LimitsReport, SandboxReport, ThreadReport
from .sandbox import SandboxCgroup
from .v1 import CgroupV1Manager
from .v2 import CgroupV2Manager

__all__ = [
    "CHILDREN", "VCPUS", "VMM", "QEMU_DEVICES",
    "CgroupBusy", "CgroupError", "CgroupIOError", "CgroupLimits", "CgroupManager",
    "CgroupPath", "CgroupPathError", "CgroupV1Manager", "CgroupV2Manager",
    "ControllerUnavailable", "DeviceRule", "InvalidLimits", "LimitsReport",
    "NoCgroupHierarchy", "NotInSandbox", "ProcessGone", "SandboxCgroup", "SandboxLayout",
    "SandboxReport", "ThreadReport", "child_for_role", "choose_manager", "detect",
    "manager_from_state", "parse_cgroupfs_path", "parse_cgroups_path", "parse_systemd_path",
    "shares_to_weight",
]
