"""Which pod sysctls the guest sets for the pod and which are refused before boot."""
from __future__ import annotations

import dataclasses

import pytest

from podvm_core.pb.cri import api_pb2 as cri
from podvm_core.ttrpc import Code
from shim import config
from shim.api import errors
from shim.pod.errors import Refused
from shim.pod.sysctls import allowed, check_pod_sysctls, namespace_of

CFG = dataclasses.replace(config.Config(), source="/etc/podvm/configuration.toml")


def allowing(*patterns: str) -> config.Config:
    return dataclasses.replace(CFG, runtime=dataclasses.replace(
        CFG.runtime, allowed_vm_wide_sysctls=patterns))


@pytest.mark.parametrize("name, namespace", [
    ("kernel.shm_rmid_forced", "ipc"), ("kernel.shmmax", "ipc"), ("kernel.msgmnb", "ipc"),
    ("kernel.sem", "ipc"), ("fs.mqueue.msg_max", "ipc"), ("kernel.domainname", "uts"),
    ("net.ipv4.ip_local_port_range", "network"), ("net.core.somaxconn", "network"),
    ("net.ipv4.conf.eth0/100.forwarding", "network"),
    ("net.ipv4.ip_unprivileged_port_start", "network"),
    ("net.core.rmem_max", None), ("net.ipv4.tcp_mem", None),
    ("net.ipv4.neigh.default.gc_thresh3", None), ("net.ipv4.route.max_size", None),
    ("vm.overcommit_memory", None), ("kernel.pid_max", None), ("kernel.semx", None),
    ("fs.file-max", None), ("user.max_user_namespaces", None),
])
def test_namespaces_as_kubernetes_and_runc_count_them(name: str, namespace: str | None) -> None:
    assert namespace_of(name) == namespace


def test_namespaced_sysctls_pass_in_either_form() -> None:
    check_pod_sysctls({"kernel.shm_rmid_forced": "1", "fs.mqueue.msg_max": "100",
                       "net/ipv4/conf/eth0.100/forwarding": "1"}, CFG)


def refusal(sysctls, cfg: config.Config = CFG) -> str:
    with pytest.raises(Refused) as caught:
        check_pod_sysctls(sysctls, cfg)
    answer = errors.to_ttrpc(caught.value)
    assert answer.code == Code.INVALID_ARGUMENT
    return answer.message


def test_a_vm_wide_sysctl_is_refused_naming_it_why_and_the_way_out() -> None:
    message = refusal({"kernel.shm_rmid_forced": "1", "vm.swappiness": "10"})
    assert "vm.swappiness=10" in message and "not namespaced" in message, message
    assert "whole guest kernel" in message, message
    assert "allowed_vm_wide_sysctls of /etc/podvm/configuration.toml" in message, message
    assert "net.core.rmem_max=1" in refusal({"net.core.rmem_max": "1"})


def test_the_configuration_lets_listed_ones_through() -> None:
    check_pod_sysctls({"vm.swappiness": "10", "net.core.rmem_max": "1"},
                      allowing("vm.*", "net.core.rmem_max"))
    assert "net.core.wmem_max" in refusal({"net.core.wmem_max": "1"},
                                          allowing("net.core.rmem_max"))
    assert allowed("kernel.pid_max", ("*",)) and not allowed("kernel.pid_max", ("kernel.pid",))


def test_hostname_and_bad_names_are_refused() -> None:
    assert "PodSandboxConfig.hostname" in refusal({"kernel.hostname": "x"})
    assert "'..' part" in refusal({"net/../kernel/core_pattern": "|/x"})
    assert "not a map" in refusal(["kernel.sem"])  # type: ignore[arg-type]


def test_the_cri_map_is_read_as_it_comes() -> None:
    pod = cri.PodSandboxConfig()
    pod.linux.sysctls["kernel.msgmax"] = "8192"
    check_pod_sysctls(pod.linux.sysctls, CFG)
    pod.linux.sysctls["kernel.panic"] = "1"
    assert "kernel.panic=1" in refusal(pod.linux.sysctls)


@pytest.mark.parametrize("pattern", ["", "vm.*.x", "**"])
def test_configuration_refuses_a_pattern_that_is_not_one(tmp_path, pattern: str) -> None:
    f = tmp_path / "c.toml"
    f.write_text(f'[runtime]\nallowed_vm_wide_sysctls = ["{pattern}"]\n')
    with pytest.raises(config.ConfigError, match="allowed_vm_wide_sysctls"):
        config.load(str(f))


def test_configuration_reads_the_patterns(tmp_path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('[runtime]\nallowed_vm_wide_sysctls = ["vm.*", "kernel.pid_max", "*"]\n')
    assert config.load(str(f)).runtime.allowed_vm_wide_sysctls == (
        "vm.*", "kernel.pid_max", "*")
