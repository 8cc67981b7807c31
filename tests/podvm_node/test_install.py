"""`podvm-node install` / `uninstall` against a scratch host root, and a REAL containerd
(Debian's 1.6) started from exactly what install wrote, in a mount namespace where the
scratch root's /opt/podvm, /etc/containerd and /etc/podvm are the host's and the host's
own QEMU, firmware and Pythons are out of sight: its podvm pod can only run from the
installed /opt/podvm (and its QEMU's exe and maps are checked to be there). Uninstall
must leave the scratch root byte for byte as it was; a host install refuses changes
nothing at all. One containerd, one pod."""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shlex
import stat
import subprocess
import tomllib

import pytest

from podvm_node import (bundle, containerd_dropin as dropin, hostcheck, hostfiles, install,
                        nodelabel)
from podvm_node.containerd_dropin import Refusal
from shim.config import HypervisorConfig
from testbed import bridgenet
from testbed.containerd import PODVM_SNIPPET, REPO_ROOT, Containerd, podvm_runtime_section
from testbed.cri import Crictl, write_config
from testbed.pods import container_config, pod_config, pod_qemus
from testbed.prereqs import require_root, require_tool
from testbed.vmconfig import guest_image, write_test_config
from tests.e2e.test_crictl import wait_for

PODVM = "/opt/podvm"
HIDDEN = ("/usr/share/qemu", "/usr/share/seabios", "/usr/lib/ipxe", "/usr/lib/qemu",
          "/usr/lib/python3.11", "/root/.pyenv", str(REPO_ROOT))
"""Out of sight of the installed containerd: the host's QEMU and its firmware, its
Pythons, this checkout (its venv and sources)."""
OPERATOR_SANDBOX_IMAGE = "localhost/podvm/pause:local"


def snapshot(root: pathlib.Path) -> dict[str, tuple]:
    """Every path under `root`: type, mode, owner, and contents (hash or link target)."""
    found = {}
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        if stat.S_ISLNK(st.st_mode):
            what = os.readlink(path)
        elif stat.S_ISREG(st.st_mode):
            what = hashlib.sha256(path.read_bytes()).hexdigest()
        else:
            what = None
        found[str(path.relative_to(root))] = (stat.S_IFMT(st.st_mode),
                                              stat.S_IMODE(st.st_mode), st.st_uid,
                                              st.st_gid, what)
    return found


@pytest.fixture(scope="module")
def node_bundle() -> pathlib.Path:
    require_root()
    require_tool("patchelf", "patchelf")
    guest_image()
    out = REPO_ROOT / "build" / "node-bundle"
    bundle.build(out)  # cached: built again only when its inputs change
    return out


@pytest.fixture
def fake_bundle(tmp_path: pathlib.Path) -> pathlib.Path:
    """A bundle's outline (what the checks read) for the refusal tests: they must stop
    before copying anything."""
    out = tmp_path / "bundle"
    (out / "etc").mkdir(parents=True)
    (out / "manifest.json").write_text("{}\n")
    (out / "etc" / "configuration.toml").write_text('[hypervisor.qemu]\naccel = "kvm"\n')
    return out


def scratch_root(tmp_path: pathlib.Path, config: str | None, podvm_config: str | None = None
                 ) -> pathlib.Path:
    root = tmp_path / "host"
    for sub in ("etc/containerd", "usr/local/bin", "run"):
        (root / sub).mkdir(parents=True)
    if config is not None:
        (root / "etc/containerd/config.toml").write_text(config)
    if podvm_config is not None:
        (root / "etc/podvm").mkdir()
        (root / "etc/podvm/configuration.toml").write_text(podvm_config)
    return root


TCG = '[hypervisor.qemu]\naccel = "tcg"\n'
V16 = "containerd github.com/containerd/containerd 1.6.20~ds1 1.6.20~ds1-1+deb12u3\n"


@pytest.mark.parametrize("case", ["no kvm", "unknown version", "version 1 config",
                                  "bad config", "v2 config for 2.x", "cgroups",
                                  "foreign shim", "opt a link", "conf.d a link"])
def test_refusals_change_nothing(tmp_path, fake_bundle, case) -> None:
    config, podvm_config, version, mountinfo = "version = 2\n", TCG, V16, None
    if case == "no kvm":
        podvm_config = None  # the bundle's accel = "kvm", and the scratch root has no kvm
    elif case == "unknown version":
        version = "containerd containerd.io v3.0.1 abc\n"
    elif case == "version 1 config":
        config, version = "[plugins.cri]\n", None
    elif case == "bad config":
        config = 'version = 2\n[plugins."io.containerd.grpc.v1.cri"\n'
    elif case == "v2 config for 2.x":
        version = "containerd containerd.io v2.0.4 abc\n"
    elif case == "cgroups":
        mountinfo = tmp_path / "mountinfo"
        mountinfo.write_text("22 1 0:21 / /proc rw - proc proc rw\n")
    root = scratch_root(tmp_path, config, podvm_config)
    if case == "foreign shim":
        (root / "usr/local/bin/containerd-shim-podvm-v2").symlink_to("/elsewhere/shim")
    elsewhere = tmp_path / "elsewhere"  # where a link in the host root would lead here
    elsewhere.mkdir()
    if case == "opt a link":
        (root / "opt").symlink_to(elsewhere)
    elif case == "conf.d a link":
        (root / "etc/containerd/conf.d").symlink_to(elsewhere)
    before = snapshot(root)
    with pytest.raises(Refusal) as refused:
        install.install(str(root), str(fake_bundle), restart=lambda: pytest.fail("restarted"),
                        version_text=version, mountinfo=str(mountinfo) if mountinfo else None)
    line = str(refused.value)
    assert "\n" not in line and line, line
    assert snapshot(root) == before, f"{case}: {line}"
    assert list(elsewhere.iterdir()) == []


def test_cli_refuses_in_one_line(tmp_path, fake_bundle, capsys) -> None:
    root = scratch_root(tmp_path, "version = 2\n")  # no /dev/kvm, no podvm configuration
    before = snapshot(root)
    status = install.main("install", ["--host-root", str(root), "--bundle", str(fake_bundle),
                                      "--restart-command", "false"])
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1, err
    assert "refused" in err and "/dev/kvm" in err
    assert snapshot(root) == before


def test_v3_dropin_is_the_packaged_snippets() -> None:
    text = dropin.dropin_text(3, {})
    ours = tomllib.loads(text)
    packaged = {}
    for name in ("config-v3.toml", "config-v3-sandboxer.toml"):
        data = tomllib.loads((REPO_ROOT / "packaging/containerd" / name).read_text())
        packaged.update(data["plugins"][dropin.CRI_V3]["containerd"]["runtimes"])
    assert ours == {"version": 3, "plugins": {dropin.CRI_V3: {"containerd": {
        "runtimes": packaged}}}}


def test_v2_dropin_carries_the_operators_cri_section() -> None:
    operator = {"version": 2, "plugins": {dropin.CRI_V2: {
        "sandbox_image": "operator/pause:9", "containerd": {"runtimes": {"runc": {
            "runtime_type": "io.containerd.runc.v2", "options": {"SystemdCgroup": True}}}},
        "registry": {"mirrors": {"docker.io": {"endpoint": ["https://m.example"]}}}}}}
    cri = tomllib.loads(dropin.dropin_text(2, operator))["plugins"][dropin.CRI_V2]
    snippet = tomllib.loads(PODVM_SNIPPET.read_text())["plugins"][dropin.CRI_V2]
    assert cri["containerd"]["runtimes"].pop("podvm") == \
        snippet["containerd"]["runtimes"]["podvm"]
    assert cri == operator["plugins"][dropin.CRI_V2]
    # no runtimes of the operator's: containerd's own runc, which a drop-in would drop
    bare = tomllib.loads(dropin.dropin_text(2, {"version": 2}))["plugins"][dropin.CRI_V2]
    assert bare["containerd"]["runtimes"]["runc"] == dropin.RUNC


@pytest.mark.parametrize("config", [
    None, "version = 2\n", "# ops\nversion = 2 # v2\n\n[grpc]\n  address = \"/x.sock\"\n",
    'version = 2\nimports = ["/etc/other.toml"]\n', "version = 2\nimports = []\n"])
def test_imports_edit_and_its_undo(tmp_path, config) -> None:
    root = scratch_root(tmp_path, config)
    before = snapshot(root)
    text, data = dropin.read_config(str(root))
    edit = dropin.imports_edit(text, data, 2)
    if edit.created:
        (root / "etc/containerd").mkdir(exist_ok=True)
    dropin.apply_edit(str(root), edit)
    after = tomllib.loads((root / "etc/containerd/config.toml").read_text())
    assert dropin.DROPIN in after["imports"]
    assert {k: v for k, v in after.items() if k != "imports"} == \
        {k: v for k, v in data.items() if k != "imports"} | {"version": 2}
    assert dropin.imports_edit((root / "etc/containerd/config.toml").read_text(), after, 2) \
        is None
    dropin.undo_edit(str(root), edit)
    assert snapshot(root) == before


def test_upgrade_swaps_the_tree_and_uninstall_undoes_both(tmp_path, fake_bundle) -> None:
    """Install twice (the second an upgrade: a new tree exchanged for the old), then
    uninstall: what the first install did (the import, the configuration it wrote) is
    still undone."""
    config = 'version = 2\nimports = ["/etc/other.toml"]\n[plugins."io.containerd.grpc.v1.cri"]\n' \
        '  sandbox_image = "operator/pause:9"\n'
    root = scratch_root(tmp_path, config)
    (root / "dev").mkdir()
    (root / "dev/kvm").write_text("")  # what check_kvm looks for
    before = snapshot(root)
    restarts: list[str] = []
    (fake_bundle / "bin").mkdir()
    (fake_bundle / "bin/marker").write_text("one\n")
    install.install(str(root), str(fake_bundle), restart=lambda: restarts.append("install"),
                    version_text=V16, say=lambda line: None)
    (fake_bundle / "bin/marker").write_text("two\n")
    install.install(str(root), str(fake_bundle), restart=lambda: restarts.append("upgrade"),
                    version_text=V16, say=lambda line: None)
    assert (root / "opt/podvm/bin/marker").read_text() == "two\n"
    assert [p.name for p in (root / "opt").iterdir()] == ["podvm"]  # no staged tree left
    data = tomllib.loads((root / "etc/containerd/config.toml").read_text())
    assert data["imports"] == [dropin.DROPIN, "/etc/other.toml"]
    cri = tomllib.loads((root / dropin.DROPIN.lstrip("/")).read_text())["plugins"][dropin.CRI_V2]
    assert cri["sandbox_image"] == "operator/pause:9" and "podvm" in cri["containerd"]["runtimes"]
    record = hostfiles.load(str(root))
    assert "/etc/podvm/configuration.toml" in record.files and record.edit is not None
    install.uninstall(str(root), restart=lambda: restarts.append("uninstall"),
                      say=lambda line: None)
    assert restarts == ["install", "upgrade", "uninstall"]
    assert snapshot(root) == before
    # nothing recorded any more: a second uninstall does nothing
    install.uninstall(str(root), restart=lambda: restarts.append("again"), say=lambda l: None)
    assert restarts[-1] == "uninstall" and snapshot(root) == before


def test_templates_are_warmed_last_and_a_failed_warm_up_keeps_the_install(
        tmp_path, fake_bundle) -> None:
    """The warm-up runs once containerd is back (its VMs use what was installed); where
    it fails (the command exits non-zero: no KVM, a full disk) the node still serves
    pods, which boot, so the install stands and says why."""
    root = scratch_root(tmp_path, 'version = 2\n')
    (root / "dev").mkdir()
    (root / "dev/kvm").write_text("")
    steps: list[str] = []
    lines: list[str] = []
    failing = install.command_warm("sh -c 'echo no room >&2; exit 3'")

    def warm() -> str:
        steps.append("warm")
        return failing()

    install.install(str(root), str(fake_bundle), restart=lambda: steps.append("restart"),
                    version_text=V16, say=lines.append, warm=warm)
    assert steps == ["restart", "warm"]
    assert any(line.startswith("templates not warmed") and "exited 3: no room" in line
               for line in lines), lines
    assert (root / "opt/podvm/manifest.json").is_file()
    assert install.command_warm("echo 1:256:1:1500: template k made")() == \
        "1:256:1:1500: template k made"
    install.uninstall(str(root), restart=lambda: None, say=lambda line: None)


def test_a_failed_install_takes_out_what_it_added(tmp_path, fake_bundle) -> None:
    root = scratch_root(tmp_path, "version = 2\n", TCG)
    before = snapshot(root)
    (fake_bundle / "share").mkdir()
    os.mkfifo(fake_bundle / "share/fifo")
    with pytest.raises(OSError, match="not a podvm bundle"):  # copying the bundle fails
        install.install(str(root), str(fake_bundle), restart=lambda: pytest.fail("restarted"),
                        version_text=V16, say=lambda line: None)
    assert snapshot(root) == before


def test_uninstall_refuses_while_a_podvm_pod_runs(tmp_path, fake_bundle) -> None:
    """containerd runs the shim binary to delete a pod: uninstall under a live shim
    would strand its pod."""
    root = scratch_root(tmp_path, "version = 2\n", TCG)
    install.install(str(root), str(fake_bundle), restart=lambda: None, version_text=V16,
                    say=lambda line: None)
    state = root / "run/podvm/k8s.io/abc"
    state.mkdir(parents=True)
    (state / "shim.json").write_text(json.dumps({"pid": os.getpid()}))
    installed = snapshot(root)
    with pytest.raises(Refusal, match="1 podvm pod"):
        install.uninstall(str(root), restart=lambda: pytest.fail("restarted"),
                          say=lambda line: None)
    assert snapshot(root) == installed
    dead = subprocess.Popen(["true"])
    dead.wait()
    (state / "shim.json").write_text(json.dumps({"pid": dead.pid}))  # a shim gone
    install.uninstall(str(root), restart=lambda: None, say=lambda line: None)
    assert not (root / "opt").exists()


def test_containerd_version_from_the_hosts_binary(tmp_path) -> None:
    require_tool("containerd", "containerd")
    assert dropin.parse_version(hostcheck.containerd_version_text("")) == (1, 6)
    assert hostcheck.containerd_version_text(str(scratch_root(tmp_path, None))) is None


def test_not_in_a_cluster_no_label() -> None:
    assert nodelabel.set_label("installed", env={}) == \
        "not in a Kubernetes cluster: no node to label"


# ---- the real thing: install, a pod from /opt/podvm, uninstall ---------------------------

class InstalledContainerd(Containerd):
    """containerd as the node runs it after install: /etc/containerd/config.toml (the
    scratch root's), the shim from /usr/local/bin, podvm from /opt/podvm."""

    def __init__(self, workdir: pathlib.Path, host: pathlib.Path) -> None:
        super().__init__(workdir, cri=True)
        self.host = host

    def operator_config(self) -> str:
        """The harness's CRI configuration without podvm: the operator's config.toml."""
        return self.config_text().replace(podvm_runtime_section(None), "")

    def _start(self, timeout: float) -> "Containerd":
        etc = self.workdir / "etc"
        hide = " ".join(shlex.quote(p) for p in HIDDEN)
        script = (
            "set -e; mount --make-rprivate /; mount -t tmpfs tmpfs /opt; "
            f"if [ -d {self.host}/opt/podvm ]; then mkdir /opt/podvm; "
            f"mount --bind {self.host}/opt/podvm /opt/podvm; fi; "
            f"mount -t overlay overlay -o lowerdir={self.host}/etc:/etc {etc}; "
            f"mount --bind {etc} /etc; "
            f"mount --bind {self.host}/usr/local/bin /usr/local/bin; "
            f"mount --bind /dev/null /usr/bin/qemu-system-x86_64; "
            f"for d in {hide}; do [ -d $d ] && mount -t tmpfs tmpfs $d; done; "
            "exec containerd --config /etc/containerd/config.toml")
        etc.mkdir(exist_ok=True)
        env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
        self._log = open(self.log_path, "ab")
        self.process = subprocess.Popen(["unshare", "--mount", "sh", "-c", script],
                                        stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                        start_new_session=True)
        try:
            install.wait_for_socket(self.address, timeout)
        except RuntimeError:
            raise RuntimeError(f"containerd did not come up:\n{self.log()[-3000:]}") from None
        wait_for("containerd's CRI", self._cri_ready, timeout)
        return self

    def restart(self) -> None:
        self.stop_keeping_network()
        self._start(30)

    def stop_keeping_network(self) -> None:
        network, self.network = self.network, None
        try:
            self.stop()
        finally:
            self.network = network


def test_install_runs_a_pod_from_opt_podvm_and_uninstall_leaves_nothing(
        tmp_path, node_bundle) -> None:
    require_tool("containerd", "containerd")
    host = tmp_path / "host"
    ctd = InstalledContainerd(tmp_path / "containerd", host)
    if not bridgenet.missing_prerequisites():
        ctd.network = bridgenet.create(ctd.cni_dir)
        bridgenet.write_conflist(ctd.network, ctd.cni_dir / "net.d")
    # a scratch path of its own: the bundle's mke2fs makes the blank
    podvm_config = write_test_config(tmp_path / "podvm.toml", enable_template=False,
                                     scratch_path=str(tmp_path / "scratch"),
                                     kernel=f"{PODVM}/share/podvm/vmlinux",
                                     initrd=f"{PODVM}/share/podvm/initrd.img",
                                     image=f"{PODVM}/share/podvm/rootfs.img",
                                     virtio_fs_daemon=f"{PODVM}/libexec/virtiofsd").read_text()
    podvm_config = podvm_config.replace("[hypervisor.qemu]\n", (
        f'[hypervisor.qemu]\npath = "{PODVM}/bin/qemu-system-x86_64"\n'
        f'scratch_mke2fs = "{PODVM}/bin/mke2fs"\n'), 1)
    scratch_root(tmp_path, ctd.operator_config(), podvm_config)
    before = snapshot(host)
    lines: list[str] = []
    try:
        install.install(str(host), str(node_bundle), restart=lambda: ctd._start(30),
                        version_text=subprocess.run(["containerd", "--version"],
                                                    capture_output=True, text=True).stdout,
                        say=lines.append)
        assert (host / "opt/podvm/manifest.json").read_bytes() == \
            (node_bundle / "manifest.json").read_bytes()
        assert os.readlink(host / "usr/local/bin/containerd-shim-podvm-v2") == \
            f"{PODVM}/bin/containerd-shim-podvm-v2"
        run_pod_from_opt_podvm(ctd, tmp_path)
        assert [p.name for p in (tmp_path / "scratch").glob("blank-*")] == \
            [f"blank-{HypervisorConfig.scratch_disk_mib}M.ext4"]
        install.uninstall(str(host), restart=ctd.restart, say=lines.append)
        crictl = Crictl(ctd.cri_endpoint)
        info = crictl.run("info").json()["config"]
        assert "podvm" not in info["containerd"]["runtimes"]
        assert "runc" in info["containerd"]["runtimes"]
    finally:
        ctd.stop()
        assert ctd.forced == [], ctd.forced
    assert snapshot(host) == before, lines


def run_pod_from_opt_podvm(ctd: InstalledContainerd, tmp_path: pathlib.Path) -> None:
    images = tmp_path / "images"
    images.mkdir()
    ctd.import_cri_images(images)
    crictl = Crictl(ctd.cri_endpoint)
    info = crictl.run("info").json()["config"]
    # the drop-in kept the operator's CRI section (containerd 1.x replaces it whole)
    assert info["sandboxImage"] == OPERATOR_SANDBOX_IMAGE
    assert {"runc", "podvm"} <= set(info["containerd"]["runtimes"])
    configs = tmp_path / "configs"
    configs.mkdir()
    pod_file = write_config(configs, "pod.json", pod_config(ctd, configs, "installed"))
    pod_id = crictl.runp(pod_file, runtime="podvm")
    try:
        cfile = write_config(configs, "c.json", container_config("c", "echo hi; sleep 600"))
        cid = crictl.create(pod_id, cfile, pod_file)
        crictl.start(cid)
        assert crictl.exec(cid, "echo", "from-the-vm").stdout.strip() == "from-the-vm"
        qemu, = wait_for("the pod's QEMU", lambda: pod_qemus(pod_id))
        assert os.readlink(f"/proc/{qemu}/exe") == f"{PODVM}/bin/qemu-system-x86_64"
        argv = pathlib.Path(f"/proc/{qemu}/cmdline").read_bytes().split(b"\0")
        assert argv[argv.index(b"-bios") + 1] == f"{PODVM}/share/qemu/qboot.rom".encode()
        files = {line.split()[-1] for line in
                 pathlib.Path(f"/proc/{qemu}/maps").read_text().splitlines()
                 if len(line.split()) == 6 and line.split()[-1].startswith("/")}
        assert files and all(f.startswith(PODVM + "/") or f.startswith("/memfd:")
                             for f in files), files
        assert f"{PODVM}/share/podvm/rootfs.img" in files
        assert f"{PODVM}/lib/ld.so" in files
    finally:
        crictl.run("stopp", pod_id, check=False)
        crictl.run("rmp", pod_id, check=False)
