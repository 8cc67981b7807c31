"""What either API asks for when it creates a pod, in the pod's terms: each adapter turns
what it received (the sandbox container's OCI spec, shim/api/task/bundle.py; a
PodSandboxConfig, shim/api/sandbox/request.py) into one PodRequest, and Pod.create
(shim/pod/pod.py) checks, plans and builds the pod from it, the same way for both."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from ..config import Config
    from ..resources import Host
    from ..resources.planner import PodPlanner
    from .podfiles import PodFiles


@dataclass(frozen=True)
class PodRequest:
    namespace: str
    """containerd's namespace."""
    id: str
    """The sandbox id."""
    planner: Callable[[Config, Host], PodPlanner]
    """The planning inputs from what the API received, made once the request has passed
    its checks (PlanError for a bad annotation)."""
    cgroups_path: str = ""
    """Where the sandbox container's cgroup would be (either syntax): the sandbox cgroup
    goes under its parent, the pod cgroup."""
    pod_name: str = ""
    pod_namespace: str = ""
    """Kubernetes' name and namespace of the pod, recorded for the node's metrics."""
    log_directory: str = ""
    """kubelet's directory of the pod's logs (/var/log/pods/<namespace>_<name>_<uid>),
    where the pod's scratch disk gets a name kubelet counts (shim/host/podlogdisk.py);
    "" where the API gave none."""
    netns: str = ""
    """The pod's network namespace as containerd made it (CNI's interfaces in it become
    the VM's); "" for a pod with a network of its own and no interface."""
    host_namespaces: tuple[str, ...] = ()
    """The host's namespaces (OCI names) the pod asks to share: refused."""
    sysctls: Mapping[str, str] = field(default_factory=dict)
    """The pod's sysctls, checked, then set in the pod's namespaces by the guest."""
    files: Callable[[], PodFiles] | None = None
    """A Sandbox-API pod's /etc files, read once the request has passed its checks
    (OSError when they cannot be); None for a Task-API pod, whose sandbox container
    brings its own."""
