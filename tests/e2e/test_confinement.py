"""QEMU confined (shim/vm/jail.py, its -sandbox) for pods made through containerd's
CRI: /proc shows the seccomp filter, no_new_privs and no capability (virtiofsd, not
QEMU, serves the pod's files); its root holds its own work directory and none of the
pod's files, no other pod's, nor containerd's. virtiofsd (shim/vm/virtiofsd.py; either
daemon, QEMU 7.2's and the Rust one) is in namespaces of its own whose root is the pod's
shared directory; a container's files, mounted after it started, reach its namespace
and leave it again; the guest's root still owns, chmods and writes its files over
virtio-fs, and cannot make device nodes;
`podvmctl status` says all this. Real containerd, real QEMU under TCG (pods restored
from a template, as by default)."""
from __future__ import annotations

import os
import pathlib

import psutil
import pytest

from shim.host import paths
from podvmctl import status
from shim.vm import jail

from tests.vmconfig import VIRTIOFS_DAEMONS, virtiofs_daemon

from .containerd import CRI_NAMESPACE, mount_namespace
from .cri import Crictl, write_config
from .test_crictl import container_config, wait_for
from .test_podvm_pods import (cri_containerd, pod_file_servers, pod_qemus, remove_pod,
                             runp, start_container)

def file_server(pod_id: str) -> int:
    """The virtiofsd process that serves the pod's files: the child that its virtiofsd
    forks into namespaces of its own."""
    pids = set(pod_file_servers(pod_id))
    children = [p for p in pids if psutil.Process(p).ppid() in pids]
    assert len(children) == 1, pids
    return children[0]


@pytest.fixture(scope="module", params=VIRTIOFS_DAEMONS)
def ctd(request, tmp_path_factory, image_cache):
    """Every test once with each virtiofsd podvm speaks to: the C one's confinement and
    the Rust one's are each proved."""
    yield from cri_containerd(tmp_path_factory, image_cache, f"podvm-jail-{request.param}",
                              f"podvm-jail-test-{request.param}",
                              virtio_fs_daemon=virtiofs_daemon(request.param))


@pytest.fixture(scope="module")
def crictl(ctd) -> Crictl:
    return Crictl(ctd.cri_endpoint, timeout="120s")


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> pathlib.Path:
    return tmp_path_factory.mktemp("podvm-jail-configs")


@pytest.fixture(scope="module")
def pods(ctd, crictl, configs):
    """Two pods: what one's QEMU sees of the other is the question."""
    ids: list[str] = []
    made = []
    try:
        for name in ("jail-a", "jail-b"):
            pod_id, pod_file = runp(crictl, ctd, configs, name)
            ids.append(pod_id)
            cid = start_container(crictl, configs, pod_id, pod_file, f"{name}-c",
                                  "echo up; sleep 1000")
            wait_for("the container's output", lambda: "up" in crictl.logs(cid).stdout)
            made.append({"pod": pod_id, "file": pod_file, "container": cid,
                         "qemu": pod_qemus(pod_id)[0]})
        yield made
    finally:
        for pod_id in ids:
            remove_pod(crictl, pod_id)


def test_a_pod_s_qemu_is_confined_as_proc_shows(pods) -> None:
    for pod in pods:
        pid = pod["qemu"]
        fields = dict(line.split(":", 1) for line in
                      pathlib.Path(f"/proc/{pid}/status").read_text().splitlines())
        assert fields["Seccomp"].strip() == "2" and fields["NoNewPrivs"].strip() == "1"
        assert int(fields["CapEff"], 16) == 0 == int(fields["CapBnd"], 16)
        shim = int(fields["PPid"])
        assert mount_namespace(pid) not in (mount_namespace(shim), mount_namespace())
        report = status.collect(status.find(pod["pod"], CRI_NAMESPACE))
        assert report["confinement"] == {"seccomp": 2, "no_new_privs": 1,
                                         "capabilities": [],
                                         "own_mount_namespace": True}
        assert "QEMU confinement: seccomp 2 (filter), no_new_privs 1, capabilities " \
               "none, own mount namespace yes" in status.render(report)


def test_its_root_has_the_pod_s_files_and_not_the_host_s(ctd, pods) -> None:
    a, b = pods
    root = f"/proc/{a['qemu']}/root"
    mine, theirs = (paths.state_dir(CRI_NAMESPACE, p["pod"]) for p in (a, b))
    assert os.path.isdir(f"{root}{mine}/vm")
    for absent in (theirs, f"{theirs}/vm", f"{mine}/shared", f"{mine}/export",
                   str(ctd.workdir), "/etc/shadow",
                   "/var/lib/containerd", "/run/containerd", f"{mine}/sandbox.json",
                   "/proc/1", "/sys/fs/cgroup"):
        assert not os.path.lexists(f"{root}{absent}"), absent
    with pytest.raises(OSError):
        pathlib.Path(f"{root}/usr/planted").write_text("x")


def test_virtiofsd_s_root_is_the_pod_s_shared_directory(pods) -> None:
    a, b = pods
    server = file_server(a["pod"])
    root = pathlib.Path(f"/proc/{server}/root")
    names = {p.name for p in root.iterdir()}  # the pod's export: a directory per container
    assert {a["pod"], a["container"]} <= names and not {b["pod"], b["container"]} & names
    assert (root / a["container"] / "rootfs" / "bin" / "busybox").is_file()
    for ns in ("mnt", "pid", "net"):
        assert os.readlink(f"/proc/{server}/ns/{ns}") != os.readlink(f"/proc/self/ns/{ns}")
    fields = dict(line.split(":", 1) for line in
                  pathlib.Path(f"/proc/{server}/status").read_text().splitlines())
    assert fields["Seccomp"].strip() == "2"
    mknod = 1 << jail.CAPABILITIES.index("mknod")
    assert int(fields["CapEff"], 16) & mknod == 0


def test_a_container_s_files_reach_qemu_after_it_started_and_leave_with_it(
        crictl, configs, pods) -> None:
    """virtiofsd binds the shared directory recursively as a slave: the rootfs of a
    container created after it started is there in its namespace (else the guest could
    not run it), and its removal unmounts it there too."""
    pod = pods[0]
    cid = start_container(crictl, configs, pod["pod"], pod["file"], "late",
                          "echo late-up; sleep 1000")
    wait_for("the late container's output", lambda: "late-up" in crictl.logs(cid).stdout)
    server_mounts = pathlib.Path(f"/proc/{file_server(pod['pod'])}/mountinfo")
    assert cid in server_mounts.read_text()
    crictl.run("stop", cid)
    crictl.run("rm", cid)
    wait_for("the late container's mounts gone from virtiofsd's namespace",
             lambda: cid not in server_mounts.read_text())


def test_the_guest_s_root_still_owns_and_modes_its_files(crictl, configs, pods,
                                                        tmp_path) -> None:
    """What virtiofsd's capabilities are for, in a host directory it serves (a volume:
    the container's own root is on its scratch disk): file ownership, modes, set-id bits;
    and what it is denied: device nodes (a guest's would be a host device node)."""
    pod = pods[1]
    volume = tmp_path / "volume"
    volume.mkdir()
    config = dict(container_config("owner", "sleep 1000"),
                  mounts=[{"container_path": "/vol", "host_path": str(volume)}])
    cid = crictl.create(pod["pod"], write_config(configs, "owner.json", config), pod["file"])
    crictl.start(cid)
    result = crictl.exec(cid, "sh", "-c",
                         "cd /vol && mkdir -p d && chown 1000:1000 d && chmod 755 d && "
                         "touch d/x f && chown 1000:1000 f && chmod 2750 f && "
                         "stat -c '%u %g %a' f d/x && mknod n c 1 3 || echo mknod-refused")
    assert result.exit_code == 0, result
    assert result.stdout.split("\n")[:3] == ["1000 1000 2750", "0 0 644", "mknod-refused"], \
        result.stdout
    st = (volume / "f").stat()  # made on the host by virtiofsd, as the guest's root asked
    assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (1000, 1000, 0o2750)
    assert not (volume / "n").exists()
    crictl.run("stop", "-t", "0", cid)
    crictl.run("rm", cid)
