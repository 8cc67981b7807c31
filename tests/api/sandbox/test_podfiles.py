"""containerd 2.x's CRI leaves /etc/resolv.conf, /etc/hosts and /etc/hostname of a
"shim"-sandboxer pod to the shim: containers created through the Task API find the ones
podvm wrote from the PodSandboxConfig, read-only (they are on the host's /run:
test_pod_files_bounded.py), and not where they mount the path themselves; the files go
with the pod."""
from __future__ import annotations

import asyncio
import json
import os
import pathlib

import pytest

from podvm_core.pb.containerd.runtime.sandbox.v1 import sandbox_pb2 as sb
from podvm_core.pb.containerd.task.v2 import shim_pb2 as api
from shim.host import paths
from testbed.shimproc import wait_gone
from testbed.taskshim import TASK, Fifos, busybox_rootfs, create, spec

from tests.api.sandbox.harness import MIB, NS, sandbox_shim

RESOLV_CONF = ("search default.svc.cluster.local svc.cluster.local\n"
               "nameserver 10.96.0.10\nnameserver 10.96.0.11\noptions ndots:5\n")


@pytest.fixture(scope="module")
def rootfs(tmp_path_factory) -> pathlib.Path:
    return busybox_rootfs(tmp_path_factory.mktemp("busybox-rootfs"))


async def shut_down(pod, pod_dir: pathlib.Path) -> None:
    """StopSandbox and ShutdownSandbox as containerd 2.x calls them: the daemon exits and
    the pod's state directory is gone."""
    await pod.call("StopSandbox", sb.StopSandboxRequest(sandbox_id=pod.id),
                   sb.StopSandboxResponse)
    await pod.call("ShutdownSandbox", sb.ShutdownSandboxRequest(sandbox_id=pod.id),
                   sb.ShutdownSandboxResponse)
    await wait_gone(pod.daemon_pid, timeout=60)
    assert not os.path.exists(pod_dir)


async def run_container(pod, tmp_path: pathlib.Path, rootfs: pathlib.Path, cid: str,
                        script: str, readonly: bool = False,
                        mounts: list[dict] | None = None,
                        capabilities: list[str] | None = None) -> str:
    """Create and start a container of the pod as CRI makes it (the pod's namespaces, no
    hostname of its own); what it printed until it exited. `capabilities`: its process's
    (none by default)."""
    bundle = tmp_path / cid
    (bundle / "rootfs").mkdir(parents=True)
    c_spec = spec(["sh", "-c", script + "; echo END"])
    c_spec["root"]["readonly"] = readonly
    if capabilities:
        c_spec["process"]["capabilities"] = dict.fromkeys(
            ("bounding", "effective", "permitted"), capabilities)
    c_spec["mounts"] += mounts or []
    c_spec["linux"]["namespaces"] = [{"type": t, "path": f"/proc/1/ns/{t}"}
                                     for t in ("pid", "ipc", "uts")] + [{"type": "mount"}]
    c_spec.pop("hostname", None)
    c_spec["annotations"] = {"io.kubernetes.cri.sandbox-id": pod.id,
                             "io.kubernetes.cri.container-type": "container"}
    (bundle / "config.json").write_text(json.dumps(c_spec))
    fifos = Fifos(tmp_path, cid)
    task = {"client": pod.client, "rootfs": rootfs, "options": api.CreateTaskRequest().options}
    await create(task, cid, bundle, fifos)
    await pod.client.call(TASK, "Start", api.StartRequest(id=cid), api.StartResponse)
    out = await fifos.read(fifos.out, b"END\n", timeout=60)
    waited = await asyncio.wait_for(pod.client.call(TASK, "Wait", api.WaitRequest(id=cid),
                                                    api.WaitResponse), 60)
    assert waited.exit_status == 0
    await pod.client.call(TASK, "Delete", api.DeleteRequest(id=cid), api.DeleteResponse)
    return out.decode()


async def test_containers_get_the_pods_resolv_conf_hosts_and_hostname(tmp_path,
                                                                      rootfs) -> None:
    async with sandbox_shim(tmp_path) as pod:
        config = pod.config(memory=64 * MIB)
        config.hostname = "dns-pod"
        config.dns_config.servers.extend(["10.96.0.10", "10.96.0.11"])
        config.dns_config.searches.extend(["default.svc.cluster.local", "svc.cluster.local"])
        config.dns_config.options.append("ndots:5")
        await pod.create(config)
        pod_dir = pathlib.Path(paths.state_dir(NS, pod.id))
        assert (pod_dir / "etc" / "resolv.conf").read_text() == RESOLV_CONF
        await pod.call("StartSandbox", sb.StartSandboxRequest(sandbox_id=pod.id),
                       sb.StartSandboxResponse)

        out = await run_container(
            pod, tmp_path, rootfs, "c1",
            "cat /etc/resolv.conf; echo hostname=$(cat /etc/hostname) uname=$(hostname); "
            "grep -c localhost /etc/hosts; grep ' /etc/resolv.conf ' /proc/self/mounts")
        assert out.startswith(RESOLV_CONF)
        assert "hostname=dns-pod uname=dns-pod\n" in out
        assert "\n2\n" in out  # the two loopback lines
        mount_line = out.splitlines()[-2]
        assert mount_line.split()[3].split(",")[0] == "ro"  # though its rootfs is writable

        # A read-only rootfs too; its own /etc/hosts stays its own
        own_hosts = tmp_path / "own-hosts"
        own_hosts.write_text("10.0.0.1\tmine\n")
        out = await run_container(
            pod, tmp_path, rootfs, "c2",
            "cat /etc/hosts; (echo x >> /etc/resolv.conf) 2>/dev/null && echo resolv=rw "
            "|| echo resolv=ro; cat /etc/hostname", readonly=True,
            mounts=[{"destination": "/etc/hosts", "type": "bind", "source": str(own_hosts),
                     "options": ["rbind", "ro"]}])
        assert out == "10.0.0.1\tmine\nresolv=ro\ndns-pod\nEND\n"
        assert (pod_dir / "etc" / "resolv.conf").read_text() == RESOLV_CONF

        await shut_down(pod, pod_dir)
