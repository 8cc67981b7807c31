"""What kubelet's pod cgroup allows, read back for the plan: a pod cgroup of exactly the
containers' limits plus the declared overhead admits the pod, whatever units they used."""
from __future__ import annotations

import os
import uuid

import cgroups
from shim.host.cgroup import pod_cgroup_limits
from shim.resources.model import MIB
from testbed.prereqs import require, require_root


def test_a_decimal_memory_limit_plus_the_overhead_is_read_whole() -> None:
    require_root()
    manager = cgroups.detect()
    require(not isinstance(manager, cgroups.CgroupV2Manager) or
            "memory" in manager.hierarchy.controllers, "a memory cgroup controller")
    pod = f"/podvm-limits-{uuid.uuid4().hex[:8]}"
    made = []
    try:
        for h in manager.hierarchies if hasattr(manager, "hierarchies") else [manager.hierarchy]:
            if {"memory", "cpu"} & set(h.controllers):
                os.mkdir(h.directory(pod))
                made.append(h.directory(pod))
                if "memory" in h.controllers:
                    name = "memory.limit_in_bytes" if hasattr(manager, "hierarchies") \
                        else "memory.max"
                    with open(os.path.join(h.directory(pod), name), "w") as f:
                        f.write(str(100_000_000 + 448 * MIB))  # a 100M container + 448Mi
        memory_mib, _ = pod_cgroup_limits(f"{pod}/sandbox")
        # the model needs ceil(100M / MiB) = 96 MiB for the workload, plus 448
        assert memory_mib == 96 + 448
    finally:
        for d in made:
            os.rmdir(d)
