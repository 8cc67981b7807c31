"""Which network a Task-API pod gets, from its sandbox container's spec: the namespace
containerd made (CNI's interfaces become the VM's), one of its own with no interface, or
the host's, which a VM cannot have and which is refused before anything is made."""
from __future__ import annotations

import pytest

from podvm_core.ttrpc import Code
from shim import config
from shim.api import errors
from shim.api.task.request import pod_request
from shim.pod.errors import Refused
from shim.pod.pod import Pod


def create(spec: dict) -> Pod:
    return Pod.create(pod_request("k8s.io", "sb", spec), config.Config())


def sandbox_spec(*namespaces: dict) -> dict:
    return {"ociVersion": "1.0.2",
            "annotations": {"io.kubernetes.cri.container-type": "sandbox"},
            "linux": {"namespaces": [{"type": "pid"}, {"type": "ipc"}, *namespaces]}}


def test_the_cni_namespace_is_the_pods_network() -> None:
    spec = sandbox_spec({"type": "network", "path": "/var/run/netns/cni-1234"})
    pod = create(spec)
    assert pod.netns == "/var/run/netns/cni-1234"


def test_a_new_namespace_without_path_is_a_pod_without_interfaces() -> None:
    pod = create(sandbox_spec({"type": "network"}))
    assert pod.netns == ""


def test_the_host_network_is_refused() -> None:
    with pytest.raises(Refused) as err:
        create(sandbox_spec())
    answer = errors.to_ttrpc(err.value)
    assert answer.code == Code.INVALID_ARGUMENT
    assert "hostNetwork: true" in answer.message and "runc" in answer.message


@pytest.mark.parametrize("missing, field", [("pid", "hostPID"), ("ipc", "hostIPC")])
def test_the_hosts_pid_and_ipc_namespaces_are_refused(missing: str, field: str) -> None:
    spec = sandbox_spec({"type": "network"})
    spec["linux"]["namespaces"] = [ns for ns in spec["linux"]["namespaces"]
                                   if ns["type"] != missing]
    with pytest.raises(Refused) as err:
        create(spec)
    answer = errors.to_ttrpc(err.value)
    assert answer.code == Code.INVALID_ARGUMENT
    assert f"{field}: true" in answer.message and "hostNetwork" not in answer.message
