"""/etc/hostname, /etc/hosts and /etc/resolv.conf of a Sandbox-API pod's containers.

containerd's CRI mounts these from the sandbox's root directory only when its own pod
sandbox controller wrote them there; with the "shim" sandboxer it leaves them to the
shim. podvm writes them from the PodSandboxConfig into the pod's state directory (which
goes with the pod) and binds them into each container that does not mount the path
itself, always read-only: the state directory is on the host's /run, a tmpfs on a node,
and whatever a container wrote there (`dd of=/etc/hosts`) would fill it, and with it
containerd's, kubelet's and every pod's sockets. This is podvm's one difference from
runc, whose containers get them read-only only when their rootfs is: a program that
rewrites /etc/hosts meets EROFS. (Kubernetes pods mostly do not: kubelet mounts its own
/etc/hosts, from its disk, which the container keeps writable.) Contents follow
containerd's pod sandbox controller: the hostname and a newline; resolv.conf from
dns_config (`search`, `nameserver` lines, `options`), else the host's; hosts the loopback
names alone (the VM's network is the pod's own: none of the host's names apply)."""
from __future__ import annotations

import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from podvm_core.pb.cri import api_pb2 as cri

HOST_RESOLV_CONF = "/etc/resolv.conf"
HOSTS = "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"
DIRECTORY = "etc"
"""Under the pod's state directory."""


@dataclass(frozen=True)
class PodFiles:
    hostname: str
    """The pod's hostname: PodSandboxConfig.hostname, else the host's (as runc pods
    have it: a UTS namespace of their own starts with the host's name)."""
    resolv_conf: str

    @classmethod
    def of(cls, pod_config: cri.PodSandboxConfig,
           host_resolv_conf: str = HOST_RESOLV_CONF) -> PodFiles:
        """OSError when there is no dns_config and the host's resolv.conf cannot be
        read (containerd refuses such a pod too)."""
        if pod_config.HasField("dns_config"):
            dns = pod_config.dns_config
            resolv = resolv_conf(dns.servers, dns.searches, dns.options)
        else:
            with open(host_resolv_conf) as f:
                resolv = f.read()
        return cls(hostname=pod_config.hostname or socket.gethostname(), resolv_conf=resolv)

    def write(self, state_dir: str) -> dict[str, str]:
        """The files under `state_dir`; {path in the container: file on the host}."""
        directory = os.path.join(state_dir, DIRECTORY)
        os.makedirs(directory, mode=0o755, exist_ok=True)
        files = {"/etc/hostname": ("hostname", f"{self.hostname}\n"),
                 "/etc/hosts": ("hosts", HOSTS),
                 "/etc/resolv.conf": ("resolv.conf", self.resolv_conf)}
        written = {}
        for destination, (name, content) in files.items():
            path = os.path.join(directory, name)
            with open(path, "w") as f:
                f.write(content)
            os.chmod(path, 0o644)
            written[destination] = path
        return written


def resolv_conf(servers: Sequence[str], searches: Sequence[str],
                options: Sequence[str]) -> str:
    """resolv.conf from a CRI DNSConfig's lists, each line only when its list is not
    empty."""
    lines = []
    if searches:
        lines.append(f"search {' '.join(searches)}")
    lines.extend(f"nameserver {server}" for server in servers)
    if options:
        lines.append(f"options {' '.join(options)}")
    return "".join(f"{line}\n" for line in lines)


def with_mounts(spec: dict, files: Mapping[str, str]) -> dict:
    """`spec` (not changed) with a read-only bind of each of `files` ({destination: host
    file}) that it does not mount itself: read-only on the host too (shim/host/share.py),
    so that not even guest root writes the host's tmpfs through them."""
    mounts = list(spec.get("mounts") or [])
    taken = {os.path.normpath(m.get("destination") or "/") for m in mounts}
    added = [{"destination": destination, "type": "bind", "source": source,
              "options": ["rbind", "rprivate", "ro"]}
             for destination, source in files.items() if destination not in taken]
    return dict(spec, mounts=mounts + added) if added else spec
