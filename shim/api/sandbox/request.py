"""The pod a CreateSandbox asks for (the Sandbox API), as the PodRequest both APIs hand to
Pod.create (shim/pod/request.py): read from the PodSandboxConfig, planned from its totals
and the pod cgroup kubelet makes for it (shim/resources/planner.py)."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Callable

from podvm_core.pb.cri import api_pb2 as cri

from ...config import Config
from ...pod.podfiles import PodFiles
from ...pod.request import PodRequest
from ...resources import Host
from ...resources.planner import PodPlanner


def pod_request(namespace: str, sandbox_id: str, pod_config: cri.PodSandboxConfig,
                annotations: Mapping[str, str], netns: str) -> PodRequest:
    """`annotations`: the PodSandboxConfig's with the request's over them."""
    options = pod_config.linux.security_context.namespace_options
    return PodRequest(
        namespace=namespace, id=sandbox_id, planner=_planner(pod_config, annotations),
        cgroups_path=_cgroups_path(pod_config.linux.cgroup_parent, sandbox_id), netns=netns,
        pod_name=pod_config.metadata.name, pod_namespace=pod_config.metadata.namespace,
        log_directory=pod_config.log_directory,
        host_namespaces=tuple(ns for ns, mode in (("network", options.network),
                                                  ("pid", options.pid), ("ipc", options.ipc))
                              if mode == cri.NODE),
        sysctls=pod_config.linux.sysctls, files=lambda: PodFiles.of(pod_config))


def _planner(pod_config: cri.PodSandboxConfig, annotations: Mapping[str, str]
             ) -> Callable[[Config, Host], PodPlanner]:
    def inputs(cfg: Config, host: Host) -> PodPlanner:
        return PodPlanner.for_pod_config(cfg, pod_config, annotations, host)

    return inputs


def _cgroups_path(cgroup_parent: str, sandbox_id: str) -> str:
    """Where the sandbox container's cgroup would be, in the parent's syntax: the
    sandbox cgroup goes next to it, under the pod cgroup."""
    if not cgroup_parent:
        return ""
    if cgroup_parent.endswith(".slice"):
        return f"{cgroup_parent}:cri-containerd:{sandbox_id}"
    return f"{cgroup_parent.rstrip('/')}/{sandbox_id}"
