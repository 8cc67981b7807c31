"""What kubelet expects of a pod and its containers (issue 18), through containerd's CRI
(Debian's 1.6) as critest drives it: pod sysctls set in the pod's namespaces, a sysctl
that would change the whole VM refused at runp, and read-only volumes that are
read-only as runc makes them (their submounts stay writable).

Real containerd, QEMU under TCG and the guest image; every test runs with the real
crictl too: CRICTL=/path/to/crictl."""
from __future__ import annotations

import pathlib

import pytest

from shim import mounts
from tests.conftest import require_root

from .cri import write_config
from .test_crictl import container_config, pod_config
from .test_podvm_pods import (configs, crictl, ctd, nothing_of_failed_pods_left,  # noqa: F401
                              remove_pod, running, runp_refused)

POD_SYSCTLS = {"kernel.shm_rmid_forced": "1", "fs.mqueue.msg_max": "100",
               "kernel.msgmax": "16384", "net.ipv4.ip_local_port_range": "40000 50000"}


def linux(ctd, **extra) -> dict:
    return {"cgroup_parent": ctd.cgroup_parent,
            "security_context": {"namespace_options": {"network": 0}}, **extra}


def run_pod(crictl, ctd, configs, name: str, container: dict, **extra) -> tuple[str, str]:
    pod_file = write_config(configs, f"pod-{name}.json",
                            pod_config(ctd, configs, name, **extra))
    pod_id = crictl.runp(pod_file, runtime="podvm")
    try:
        cid = crictl.create(pod_id, write_config(configs, f"{name}-c.json", container),
                            pod_file)
        crictl.start(cid)
    except BaseException:
        remove_pod(crictl, pod_id)
        raise
    return pod_id, cid


def test_pod_sysctls_are_set_in_the_pod_s_namespaces_before_its_containers(
        ctd, crictl, configs) -> None:
    pod_id, cid = run_pod(crictl, ctd, configs, "sysctls",
                          container_config("reader", "exec sleep 1000"),
                          linux=linux(ctd, sysctls=POD_SYSCTLS))
    try:
        read = crictl.exec(cid, "sh", "-c", "for f in kernel/shm_rmid_forced "
                           "fs/mqueue/msg_max kernel/msgmax net/ipv4/ip_local_port_range; "
                           "do echo \"$f=$(cat /proc/sys/$f)\"; done")
        assert read.exit_code == 0, read
        assert read.stdout.split("\n")[:4] == [
            "kernel/shm_rmid_forced=1", "fs/mqueue/msg_max=100", "kernel/msgmax=16384",
            "net/ipv4/ip_local_port_range=40000\t50000"], read.stdout
    finally:
        remove_pod(crictl, pod_id)


def test_a_sysctl_that_would_change_the_whole_vm_is_refused_at_runp(ctd, crictl,
                                                                    configs) -> None:
    before = running(ctd)
    error = runp_refused(crictl, ctd, configs, "vm-wide",
                         linux=linux(ctd, sysctls={"kernel.shm_rmid_forced": "1",
                                                   "vm.swappiness": "10"}))
    assert "InvalidArgument" in error and "vm.swappiness=10" in error, error
    assert "not namespaced" in error and "allowed_vm_wide_sysctls" in error, error
    assert "QEMU" not in error, error
    nothing_of_failed_pods_left(ctd, before)


@pytest.fixture
def volume(tmp_path: pathlib.Path):
    """A host directory with a tmpfs mounted below it, as a volume with a submount."""
    require_root()
    path = tmp_path / "volume"
    (path / "cache").mkdir(parents=True)
    (path / "top").write_text("top\n")
    mounts.mount(mounts.Mount("tmpfs", "tmpfs", ("size=1m",)), str(path / "cache"))
    yield path
    mounts.unmount_all(str(path))


def test_a_read_only_volume_keeps_its_submounts_writable(ctd, crictl, configs,
                                                         volume) -> None:
    """`readonly: true`, `recursive_read_only` unset: on runc the remount that makes the
    bind read-only is its top's only."""
    container = dict(container_config("writer", "exec sleep 1000"),
                     mounts=[{"container_path": "/data", "host_path": str(volume),
                              "readonly": True}])
    pod_id, cid = run_pod(crictl, ctd, configs, "ro-volume", container)
    try:
        top = crictl.exec(cid, "sh", "-c", "cat /data/top && echo changed > /data/top")
        assert top.exit_code != 0 and "top" in top.stdout, top
        assert "Read-only file system" in top.stderr, top
        below = crictl.exec(cid, "sh", "-c", "echo from-the-pod > /data/cache/note")
        assert below.exit_code == 0, below
        assert (volume / "cache" / "note").read_text() == "from-the-pod\n"
        assert (volume / "top").read_text() == "top\n"
    finally:
        remove_pod(crictl, pod_id)
