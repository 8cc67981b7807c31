"""The pod a sandbox container's Create asks for (the Task API), as the PodRequest both
APIs hand to Pod.create (shim/pod/request.py): read from its OCI spec, and planned with
the pod cgroup kubelet made above its cgroupsPath."""
from __future__ import annotations

from typing import Callable

from ...config import Config
from ...host.cgroup import pod_cgroup_limits
from ...pod.hostns import HOST_NAMESPACES, spec_namespaces
from ...pod.request import PodRequest
from ...resources import Host
from ...resources.planner import PodPlanner

POD_NAME = "io.kubernetes.cri.sandbox-name"
POD_NAMESPACE = "io.kubernetes.cri.sandbox-namespace"
LOG_DIRECTORY = "io.kubernetes.cri.sandbox-log-directory"


def pod_request(namespace: str, sandbox_id: str, spec: dict) -> PodRequest:
    linux = spec.get("linux") or {}
    cgroups_path = linux.get("cgroupsPath") or ""
    namespaces = spec_namespaces(spec)
    annotations = spec.get("annotations") or {}
    return PodRequest(
        namespace=namespace, id=sandbox_id, planner=_planner(spec, cgroups_path),
        cgroups_path=cgroups_path, netns=namespaces.get("network", ""),
        pod_name=annotations.get(POD_NAME, ""),
        pod_namespace=annotations.get(POD_NAMESPACE, ""),
        log_directory=annotations.get(LOG_DIRECTORY, ""),
        # A namespace the spec does not list is the host's.
        host_namespaces=tuple(ns for ns in HOST_NAMESPACES if ns not in namespaces),
        sysctls=linux.get("sysctl") or {})


def _planner(spec: dict, cgroups_path: str) -> Callable[[Config, Host], PodPlanner]:
    def inputs(cfg: Config, host: Host) -> PodPlanner:
        memory_mib, cpus = pod_cgroup_limits(cgroups_path)
        return PodPlanner.for_sandbox(cfg, spec, host, memory_mib, cpus)

    return inputs
