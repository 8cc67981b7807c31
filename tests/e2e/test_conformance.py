"""What kubelet expects of a pod and its containers (issue 18), through containerd's CRI
(Debian's 1.6) as critest drives it: pod sysctls set in the pod's namespaces, a sysctl
that would change the whole VM refused at runp, and read-only volumes that are
read-only as runc makes them (their submounts stay writable, and removable while the
pod runs: critest's cleanup), privileged containers with
the kernel features runc gives them (bridges), mount propagation from the
host refused when the container's task is made.

Real containerd, QEMU under TCG and the guest image; every test runs with the real
crictl too: CRICTL=/path/to/crictl."""
from __future__ import annotations

import pathlib
import shutil
import subprocess

import pytest

from shim.host import mounts, paths
from testbed.containerd import mounts_under, shims_of
from testbed.cri import CrictlFailed, write_config
from testbed.pods import container_config, pod_config
from testbed.prereqs import require_root

from .test_podvm_pods import (configs, crictl, nothing_of_failed_pods_left,  # noqa: F401
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
        # the pod's uts namespace is named as the PodSandboxConfig says (critest's "set
        # hostname"): the sandbox container's spec carries it to the guest's holder
        hostname = crictl.exec(cid, "hostname")
        assert (hostname.exit_code, hostname.stdout) == (0, "sysctls\n"), hostname
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


def test_a_volume_s_submount_goes_while_the_pod_runs(ctd, crictl, configs,
                                                    tmp_path: pathlib.Path) -> None:
    """critest's read-only mount specs, cleanup included: a tmpfs mounted at
    HOSTPATH/tmpfs after the pod started, HOSTPATH a read-only volume; while the container
    runs, `umount -l` of the tmpfs and removing HOSTPATH succeed (the shim's binds are in
    the pod's own mount namespace, not mountpoints of the host's: EBUSY before)."""
    require_root()
    pod_file = write_config(configs, "pod-rro-cleanup.json",
                            pod_config(ctd, configs, "rro-cleanup"))
    pod_id = crictl.runp(pod_file, runtime="podvm")
    try:
        host_path = tmp_path / "hostpath"
        (host_path / "tmpfs").mkdir(parents=True)
        (host_path / "top").write_text("top\n")
        mounts.mount(mounts.Mount("tmpfs", "tmpfs", ("size=1m",)), str(host_path / "tmpfs"))
        (host_path / "tmpfs" / "note").write_text("in the tmpfs\n")
        container = dict(container_config("rro-cleanup", "exec sleep 1000"),
                         mounts=[{"container_path": "/mnt", "host_path": str(host_path),
                                  "readonly": True}])
        cid = crictl.create(pod_id, write_config(configs, "rro-cleanup-c.json", container),
                            pod_file)
        crictl.start(cid)
        seen = crictl.exec(cid, "sh", "-c", "cat /mnt/top /mnt/tmpfs/note && "
                           "touch /mnt/tmpfs/file && ! touch /mnt/file")
        assert seen.exit_code == 0, seen
        assert seen.stdout == "top\nin the tmpfs\n", seen
        assert "Read-only file system" in seen.stderr, seen
        assert (host_path / "tmpfs" / "file").exists()
        # the pod's binds of it are in its shim's mount namespace, not the host's
        shim = [pid for pid, cmd in shims_of(ctd.address) if pod_id in cmd]
        assert len(shim) == 1, shim
        assert [m for m in mounts_under(paths.STATE_ROOT, shim[0]) if cid in m]
        assert not [m for m in mounts_under(paths.STATE_ROOT) if pod_id in m]
        assert mounts.unmount(str(host_path / "tmpfs"))  # umount(MNT_DETACH), as critest
        shutil.rmtree(host_path)  # os.RemoveAll: "device or resource busy" before
        assert not host_path.exists()
        assert crictl.inspect(cid)["status"]["state"] == "CONTAINER_RUNNING"
    finally:
        mounts.unmount_all(str(tmp_path))
        remove_pod(crictl, pod_id)


def test_mount_propagation_from_the_host_is_refused(ctd, crictl, configs,
                                                   tmp_path: pathlib.Path) -> None:
    """HostToContainer and Bidirectional cannot reach a VM's mount table: the container's
    first call that reaches the shim (StartContainer: containerd's CreateContainer only
    records it) fails with InvalidArgument naming the mount, and the pod is as it was (a
    container with the same volume, propagation None, still runs)."""
    require_root()
    shared = tmp_path / "shared"
    shared.mkdir()
    # containerd itself checks that the host side is a shared (or slave) mount first
    mounts.mount(mounts.Mount("tmpfs", "tmpfs", ("size=1m",)), str(shared))
    try:
        subprocess.run(["mount", "--make-shared", str(shared)], check=True)
        pod_file = write_config(configs, "pod-propagation.json",
                                pod_config(ctd, configs, "propagation"))
        pod_id = crictl.runp(pod_file, runtime="podvm")
        try:
            for propagation, field, option in (
                    ("PROPAGATION_HOST_TO_CONTAINER", "HostToContainer", "rslave"),
                    ("PROPAGATION_BIDIRECTIONAL", "Bidirectional", "rshared")):
                container = dict(container_config(field.lower(), "exec sleep 1000"),
                                 mounts=[{"container_path": "/shared",
                                          "host_path": str(shared),
                                          "propagation": propagation}])
                cid = crictl.create(pod_id, write_config(configs, f"{field}.json", container),
                                    pod_file)
                with pytest.raises(CrictlFailed) as refused:
                    crictl.start(cid)
                message = str(refused.value)
                assert "InvalidArgument" in message, message
                assert f"/shared ({option}: mountPropagation {field})" in message, message
            private = dict(container_config("private", "exec sleep 1000"),
                           mounts=[{"container_path": "/shared", "host_path": str(shared)}])
            cid = crictl.create(pod_id, write_config(configs, "private.json", private),
                                pod_file)
            crictl.start(cid)
            wrote = crictl.exec(cid, "sh", "-c", "echo private > /shared/note")
            assert wrote.exit_code == 0, wrote
            assert (shared / "note").read_text() == "private\n"
        finally:
            remove_pod(crictl, pod_id)
    finally:
        mounts.unmount_all(str(shared))


def test_a_privileged_container_makes_a_bridge_as_on_runc(ctd, crictl, configs) -> None:
    """critest's own check (`brctl addbr`): the guest kernel loads the bridge module on
    demand, for a privileged container and for one with NET_ADMIN added; without it the
    container may not."""
    security = {"namespace_options": {"network": 0}, "privileged": True}
    privileged = dict(container_config("privileged", "exec sleep 1000"),
                      linux={"security_context": {"privileged": True}})
    pod_id, cid = run_pod(crictl, ctd, configs, "privileged", privileged,
                          linux={"cgroup_parent": ctd.cgroup_parent,
                                 "security_context": security})
    try:
        made = crictl.exec(cid, "sh", "-c", "brctl addbr foobar && ip link show foobar")
        assert made.exit_code == 0 and "foobar" in made.stdout, made
        pod_file = configs / "pod-privileged.json"
        for name, caps in (("net-admin", {"add_capabilities": ["NET_ADMIN"]}), ("plain", {})):
            config = dict(container_config(name, "exec sleep 1000"),
                          linux={"security_context": {"capabilities": caps}})
            other = crictl.create(pod_id, write_config(configs, f"{name}.json", config),
                                  pod_file)
            crictl.start(other)
            tried = crictl.exec(other, "sh", "-c", f"brctl addbr br-{name[:5]}")
            assert (tried.exit_code == 0) == bool(caps), tried
    finally:
        remove_pod(crictl, pod_id)
