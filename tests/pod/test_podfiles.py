"""A Sandbox-API pod's /etc/hostname, /etc/hosts and /etc/resolv.conf: their contents as
containerd's pod sandbox controller writes them, and the binds every container gets."""
from __future__ import annotations

import os
import socket
import stat

import pytest

from podvm_core.pb.cri import api_pb2 as cri
from shim.vm import guestspec
from shim.pod.podfiles import HOSTS, PodFiles, resolv_conf, with_mounts


def dns_pod(hostname: str = "web-0") -> cri.PodSandboxConfig:
    config = cri.PodSandboxConfig(hostname=hostname)
    config.dns_config.servers.extend(["10.96.0.10", "10.96.0.11"])
    config.dns_config.searches.extend(["default.svc.cluster.local", "cluster.local"])
    config.dns_config.options.extend(["ndots:5", "timeout:1"])
    return config


def test_resolv_conf_from_dns_config_is_containerds_format() -> None:
    assert PodFiles.of(dns_pod()) == PodFiles(
        hostname="web-0",
        resolv_conf="search default.svc.cluster.local cluster.local\n"
                    "nameserver 10.96.0.10\nnameserver 10.96.0.11\n"
                    "options ndots:5 timeout:1\n")


def test_resolv_conf_has_only_the_lines_whose_lists_are_set() -> None:
    assert resolv_conf(["1.1.1.1"], [], []) == "nameserver 1.1.1.1\n"
    assert resolv_conf([], ["a.example"], ["ndots:2"]) == "search a.example\noptions ndots:2\n"
    # a dns_config with nothing in it is an empty resolv.conf, not the host's
    config = cri.PodSandboxConfig(hostname="p")
    config.dns_config.SetInParent()
    assert PodFiles.of(config, host_resolv_conf="/nonexistent").resolv_conf == ""


def test_without_dns_config_the_hosts_resolv_conf_and_hostname(tmp_path) -> None:
    host_file = tmp_path / "resolv.conf"
    host_file.write_text("# the node's\nnameserver 192.0.2.53\n")
    files = PodFiles.of(cri.PodSandboxConfig(), host_resolv_conf=str(host_file))
    assert files == PodFiles(hostname=socket.gethostname(),
                             resolv_conf="# the node's\nnameserver 192.0.2.53\n")
    with pytest.raises(FileNotFoundError):
        PodFiles.of(cri.PodSandboxConfig(), host_resolv_conf=str(tmp_path / "missing"))


def test_written_into_the_pods_directory(tmp_path) -> None:
    written = PodFiles.of(dns_pod()).write(str(tmp_path))
    assert written == {"/etc/hostname": str(tmp_path / "etc" / "hostname"),
                       "/etc/hosts": str(tmp_path / "etc" / "hosts"),
                       "/etc/resolv.conf": str(tmp_path / "etc" / "resolv.conf")}
    assert (tmp_path / "etc" / "hostname").read_text() == "web-0\n"
    assert (tmp_path / "etc" / "hosts").read_text() == HOSTS
    assert HOSTS.splitlines() == ["127.0.0.1\tlocalhost",
                                  "::1\tlocalhost ip6-localhost ip6-loopback"]
    assert "nameserver 10.96.0.10\n" in (tmp_path / "etc" / "resolv.conf").read_text()
    for path in written.values():
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o644


FILES = {"/etc/hostname": "/pod/etc/hostname", "/etc/hosts": "/pod/etc/hosts",
         "/etc/resolv.conf": "/pod/etc/resolv.conf"}


def container_spec(readonly: bool = False, mounts: list[dict] | None = None) -> dict:
    return {"root": {"path": "rootfs", "readonly": readonly},
            "mounts": mounts or [{"destination": "/proc", "type": "proc", "source": "proc"}]}


def test_every_file_bound_where_the_spec_mounts_nothing() -> None:
    spec = container_spec()
    out = with_mounts(spec, FILES)
    assert out["mounts"][1:] == [
        {"destination": d, "type": "bind", "source": s, "options": ["rbind", "rprivate", "ro"]}
        for d, s in FILES.items()]
    assert spec == container_spec()  # the caller's spec is left alone


@pytest.mark.parametrize("readonly", [False, True])
def test_read_only_whether_the_rootfs_is_or_not(readonly: bool) -> None:
    """They are on the host's /run: a container that could write them would fill it."""
    out = with_mounts(container_spec(readonly=readonly), FILES)
    assert {m["destination"]: m["options"][-1] for m in out["mounts"][1:]} == \
        dict.fromkeys(FILES, "ro")


def test_a_path_the_spec_mounts_itself_is_left_to_it() -> None:
    own = {"destination": "/etc/hosts/", "type": "bind", "source": "/kubelet/etc-hosts",
           "options": ["rbind", "rw"]}
    out = with_mounts(container_spec(mounts=[own]), FILES)
    assert [m["destination"] for m in out["mounts"]] == ["/etc/hosts/", "/etc/hostname",
                                                           "/etc/resolv.conf"]
    assert out["mounts"][0] is own


def test_no_files_no_change() -> None:
    spec = container_spec()
    assert with_mounts(spec, {}) is spec


def test_they_reach_the_guest_as_binds_of_the_shared_directory() -> None:
    guest = guestspec.rewrite(with_mounts(container_spec(), FILES), "c1",
                              submounts=lambda source: [])
    assert {(b.source, b.readonly) for b in guest.binds} == \
        {(s, True) for s in FILES.values()}
    resolv, = [m for m in guest.spec["mounts"] if m["destination"] == "/etc/resolv.conf"]
    assert resolv["source"].startswith(f"{guestspec.GUEST_SHARED}/c1/mounts/")
    assert "ro" in resolv["options"]
