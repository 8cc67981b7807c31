"""QEMU confined (shim/vm/qemu/jail.py, its -sandbox) for pods made through containerd's
CRI: /proc shows the seccomp filter, no_new_privs and no capability (virtiofsd, not
QEMU, serves the pod's files); its root holds its own work directory and none of the
pod's files, no other pod's, nor containerd's. virtiofsd (shim/vm/virtiofsd.py; either
daemon, QEMU 7.2's and the Rust one) is in namespaces of its own whose root is the pod's
shared directory; a container's files, mounted after it started, reach its namespace
and leave it again; the guest's root still owns, chmods and writes its files over
virtio-fs, and cannot make device nodes; the extended attributes it sets are its own (under
`user.virtiofs.` on the host), it cannot set a file capability nor see the host's
attributes but for the image's file capabilities (tests/e2e/xattrprobe.c asks);
`podvmctl status` says all this. Real containerd, real QEMU under TCG (pods restored
from a template, as by default)."""
from __future__ import annotations

import os
import pathlib
import struct
import subprocess

import psutil
import pytest

from shim.host import paths
from podvmctl import status
from shim.vm.qemu import jail

from testbed.containerd import CRI_NAMESPACE, mount_namespace
from testbed.cri import Crictl, write_config
from testbed.pods import container_config, pod_file_servers, pod_qemus
from testbed.prereqs import require_tool
from testbed.vmconfig import VIRTIOFS_DAEMONS, virtiofs_daemon

from .test_crictl import wait_for
from .test_podvm_pods import cri_containerd, remove_pod, runp, start_container

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
        ids = int(fields["Uid"].split()[0])
        assert fields["Uid"].split() == [str(ids)] * 4 and ids >= 1_800_000_000
        assert report["confinement"] == {"uid": ids, "gid": ids, "seccomp": 2,
                                         "no_new_privs": 1, "capabilities": [],
                                         "own_namespaces": ["mnt", "net", "ipc", "uts"]}
        rendered = status.render(report)
        assert f"QEMU confinement: uid {ids} gid {ids}, seccomp 2 (filter), no_new_privs " \
               f"1, capabilities none, own namespaces mnt,net,ipc,uts" in rendered
        # the file daemon's: root with its file capabilities, in its sandbox's namespaces
        # and the IPC and UTS ones the shim adds
        (server, *_) = [d for d in report["file_daemon"] if "pid" in d["own_namespaces"]]
        assert server["uid"] == 0 and server["seccomp"] == 2 and "mknod" not in \
            server["capabilities"]
        assert set(server["own_namespaces"]) >= {"mnt", "pid", "net", "ipc", "uts"}
        assert f"file daemon {server['pid']} confinement: uid 0 gid 0, seccomp 2" in rendered
    a, b = pods
    assert status.collect(status.find(a["pod"], CRI_NAMESPACE))["confinement"]["uid"] != \
        status.collect(status.find(b["pod"], CRI_NAMESPACE))["confinement"]["uid"]


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
    for ns in ("mnt", "pid", "net", "ipc", "uts"):
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


XATTR_PROBE = pathlib.Path(__file__).with_name("xattrprobe.c")
FILE_CAPABILITY = struct.pack("<5I", 0x02000001, 1 << 13, 0, 0, 0)
"""A valid vfs_cap_data (revision 2, effective): cap_net_raw, as `setcap cap_net_raw+ep`."""
ACL = struct.pack("<I", 2) + b"".join(struct.pack("<HHI", tag, perm, uid) for tag, perm, uid in (
    (0x01, 6, 0xFFFFFFFF), (0x02, 7, 1234), (0x04, 4, 0xFFFFFFFF), (0x10, 7, 0xFFFFFFFF),
    (0x20, 0, 0xFFFFFFFF)))
"""A valid system.posix_acl_access: user 1234 may read, write and run the file."""


@pytest.fixture(scope="module")
def xattr_probe(tmp_path_factory) -> pathlib.Path:
    """tests/e2e/xattrprobe.c, static (the busybox image has no getfattr or libc)."""
    directory = tmp_path_factory.mktemp("xattrprobe")
    built = subprocess.run([require_tool("gcc", "gcc"), "-static", "-O2", "-o",
                            str(directory / "xattrprobe"), str(XATTR_PROBE)],
                           capture_output=True, text=True, timeout=180)
    assert built.returncode == 0, built.stderr
    return directory


def probe_xattrs(crictl, cid: str, path: str, *ops: str) -> dict[str, str]:
    """xattrprobe's answer to each op on `path` in the container: "ok ..." or an errno
    name; a listing's names sorted."""
    result = crictl.exec(cid, "/probe/xattrprobe", path, *ops)
    assert result.exit_code == 0, result
    said = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    if said.get("list", "").startswith("ok"):
        said["list"] = " ".join(["ok", *sorted(said["list"].split()[1:])])
    return said


def host_xattrs(path: pathlib.Path) -> dict[str, bytes]:
    return {name: os.getxattr(path, name, follow_symlinks=False)
            for name in os.listxattr(path, follow_symlinks=False)}


def test_the_guest_s_extended_attributes_mean_nothing_to_the_host(request, crictl, configs,
                                                                  pods, xattr_probe,
                                                                  tmp_path) -> None:
    """The guest's root (CAP_SYS_ADMIN and CAP_SETFCAP in the guest) in a volume, through
    the daemon's XATTR_MAP (shim/vm/virtiofsd.py): its `trusted.*` and `security.*` are
    stored under `user.virtiofs.` (a `trusted.overlay.*` of its own would be the host's
    overlayfs's word otherwise, a `security.*` an LSM's), its file capability is refused
    (the daemon has no CAP_SETFCAP: a guest's would be one the host honours), and the
    host's own attributes are out of its sight, by name and in listings, but for the
    image's file capabilities. POSIX ACLs (neither daemon is told posix_acl): QEMU 7.2's
    stores the guest's system.posix_acl_access as any other name, under `user.virtiofs.`
    (an ACL the host never applies), the Rust one refuses it (EOPNOTSUPP); the host's own
    ACL is hidden from the guest either way."""
    c_daemon = request.node.callspec.params["ctd"] == "qemu-7.2"
    volume = tmp_path / "volume"
    volume.mkdir()
    guest_set, host_set = volume / "guest-set", volume / "host-set"
    guest_set.write_text("x")
    host_set.write_text("x")
    for name, value in (("trusted.host", b"host-trusted"), ("security.host", b"host-security"),
                        ("user.host", b"host-user"), ("security.capability", FILE_CAPABILITY),
                        ("system.posix_acl_access", ACL)):
        os.setxattr(host_set, name, value)
    before = host_xattrs(host_set)
    config = dict(container_config("xattrs", "sleep 1000"),
                  linux={"security_context": {"capabilities": {
                      "add_capabilities": ["SYS_ADMIN"]}}},
                  mounts=[{"container_path": "/vol", "host_path": str(volume)},
                          {"container_path": "/probe", "host_path": str(xattr_probe),
                           "readonly": True}])
    pod = pods[0]
    cid = crictl.create(pod["pod"], write_config(configs, "xattrs.json", config), pod["file"])
    crictl.start(cid)
    try:
        wrote = probe_xattrs(
            crictl, cid, "/vol/guest-set", f"set:trusted.x={b'guest-trusted'.hex()}",
            f"set:security.x={b'guest-security'.hex()}",
            f"set:security.capability={FILE_CAPABILITY.hex()}",
            f"set:system.posix_acl_access={ACL.hex()}", "get:trusted.x", "get:security.x",
            "get:security.capability", "get:system.posix_acl_access", "list")
        read = probe_xattrs(crictl, cid, "/vol/host-set", "list", "get:trusted.host",
                            "get:security.host", "get:user.host", "get:security.capability",
                            "get:system.posix_acl_access")
    finally:
        crictl.run("stop", "-t", "0", cid)
        crictl.run("rm", cid)
    guest_acl = ("ok", f"ok {ACL.hex()}", " system.posix_acl_access") if c_daemon else \
        ("EOPNOTSUPP", "EOPNOTSUPP", "")
    assert list(wrote.values()) == [
        "ok", "ok", "EPERM", guest_acl[0],
        f"ok {b'guest-trusted'.hex()}", f"ok {b'guest-security'.hex()}", "ENODATA",
        guest_acl[1], f"ok security.x{guest_acl[2]} trusted.x"], wrote
    stored = {"user.virtiofs.trusted.x": b"guest-trusted",
              "user.virtiofs.security.x": b"guest-security"}
    if c_daemon:
        stored["user.virtiofs.system.posix_acl_access"] = ACL
    assert host_xattrs(guest_set) == stored
    assert list(read.values()) == [
        "ok security.capability", "ENODATA", "ENODATA", "ENODATA",
        f"ok {FILE_CAPABILITY.hex()}", "ENODATA" if c_daemon else "EOPNOTSUPP"], read
    assert host_xattrs(host_set) == before
