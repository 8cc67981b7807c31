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
import signal
import stat
import subprocess
import sys
import tomllib

import pytest

from podvm_core import treegc, trees
from podvm_node import (bundle, containerd_dropin as dropin, elfpatch, hostcheck, hostfiles,
                        install, nodelabel)
from podvm_node.containerd_dropin import Refusal
from shim import config as shim_config
from shim.contract import delete as shim_delete
from shim.vm import scratchdisk
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
    (fake_bundle / "inputs.sha256").write_text("one\n")
    install.install(str(root), str(fake_bundle), restart=lambda: restarts.append("install"),
                    version_text=V16, say=lambda line: None)
    (fake_bundle / "bin/marker").write_text("two\n")
    (fake_bundle / "inputs.sha256").write_text("two\n")
    install.install(str(root), str(fake_bundle), restart=lambda: restarts.append("upgrade"),
                    version_text=V16, say=lambda line: None)
    assert (root / "opt/podvm/current/bin/marker").read_text() == "two\n"
    assert [p.name for p in (root / "opt").iterdir()] == ["podvm"]  # no staged tree left
    # the first tree, which no process uses, is gone
    assert sorted(p.name for p in (root / "opt/podvm").iterdir()) == \
        sorted([".installed", "current", hostfiles.tree_name(str(fake_bundle))])
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
    assert (root / "opt/podvm/current/manifest.json").is_file()
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


def tree_bundle(tmp_path: pathlib.Path, name: str) -> pathlib.Path:
    """A fake bundle (see fake_bundle) with what relocation rewrites: an executable whose
    loader is the flat layout's (/opt/podvm/lib/ld.so, a copy of sleep) and a script
    with the flat layout's #!; its own content (inputs.sha256), so its own tree."""
    out = tmp_path / name
    (out / "etc").mkdir(parents=True)
    (out / "bin").mkdir()
    (out / "manifest.json").write_text("{}\n")
    (out / "inputs.sha256").write_text(name + "\n")
    (out / "etc/configuration.toml").write_text('[hypervisor.qemu]\naccel = "kvm"\n')
    sleep = out / "bin/sleep"
    sleep.write_bytes(pathlib.Path("/bin/sleep").read_bytes())
    sleep.chmod(0o755)
    elfpatch.set_interpreter(str(sleep), f"{PODVM}/lib/ld.so")
    (out / "bin/podvmctl").write_text(f"#!{PODVM}/python/bin/python3.11 -I\nimport sys\n")
    (out / "bin/podvmctl").chmod(0o755)
    return out


def kvm_root(tmp_path: pathlib.Path) -> pathlib.Path:
    root = scratch_root(tmp_path, "version = 2\n")
    (root / "dev").mkdir()
    (root / "dev/kvm").write_text("")
    return root


def run_from_tree(root: pathlib.Path, tree: str) -> subprocess.Popen:
    """A process of `tree` (its executable is there), as a pod's shim or QEMU is: run
    through the system's loader, the tree's being a scratch path's."""
    return subprocess.Popen(["/lib64/ld-linux-x86-64.so.2", str(root) + tree + "/bin/sleep",
                             "600"], cwd=str(root) + tree)


def test_upgrade_under_a_running_process_keeps_its_tree_until_it_is_gone(tmp_path) -> None:
    """Install A, a process of A's tree runs (a pod's shim), install B: `current` and the
    shim link lead to B, A's tree stays as it was; once the process is gone the next
    install (B again: its tree as it is) removes A; uninstall leaves the root as before."""
    root = kvm_root(tmp_path)
    before = snapshot(root)
    a, b = tree_bundle(tmp_path, "a"), tree_bundle(tmp_path, "b")
    name_a, name_b = hostfiles.tree_name(str(a)), hostfiles.tree_name(str(b))
    assert name_a != name_b and len(name_a) == 6
    lines: list[str] = []
    install.install(str(root), str(a), restart=lambda: None, version_text=V16, say=lines.append)
    opt = root / "opt/podvm"
    assert os.readlink(opt / "current") == name_a
    assert os.readlink(root / "usr/local/bin/containerd-shim-podvm-v2") == \
        f"{PODVM}/current/bin/containerd-shim-podvm-v2"
    # each tree's executables lead to its own loader and Python, not through `current`
    exe = (opt / name_a / "bin/sleep").read_bytes()
    assert elfpatch.interpreter(exe) == f"{PODVM}/{name_a}/lib/ld.so"
    assert (opt / name_a / "bin/podvmctl").read_text().splitlines()[0] == \
        f"#!{PODVM}/{name_a}/python/bin/python3.11 -I"
    tree_a = snapshot(opt / name_a)
    pod = run_from_tree(root, f"{PODVM}/{name_a}")
    try:
        install.install(str(root), str(b), restart=lambda: None, version_text=V16,
                        say=lines.append)
        assert os.readlink(opt / "current") == name_b
        assert snapshot(opt / name_a) == tree_a and pod.poll() is None
        assert any(line.startswith(f"kept for their running pods: {name_a}")
                   for line in lines), lines
    finally:
        pod.kill()
        pod.wait()
    install.install(str(root), str(b), restart=lambda: None, version_text=V16,
                    say=lines.append)
    assert f"removed trees no process uses any more: {name_a}" in lines
    assert sorted(p.name for p in opt.iterdir()) == sorted([".installed", "current", name_b])
    install.uninstall(str(root), restart=lambda: None, say=lines.append)
    assert snapshot(root) == before


def test_uninstall_under_a_running_pod_leaves_its_tree_to_its_last_shim(tmp_path) -> None:
    """Uninstall no longer refuses: it takes out the drop-in and the record, and leaves
    the tree a running process uses, `current` and the shim's link, with the note; the
    last process of it to exit (a shim's daemon: treegc.collect_retired) removes those
    and what install made, so the root is as before. Installing again meanwhile takes
    the note back into the record."""
    root = kvm_root(tmp_path)
    before = snapshot(root)
    a = tree_bundle(tmp_path, "a")
    name = hostfiles.tree_name(str(a))
    install.install(str(root), str(a), restart=lambda: None, version_text=V16,
                    say=lambda line: None)
    state = root / "run/podvm/k8s.io/abc"
    state.mkdir(parents=True)
    (state / "shim.json").write_text(json.dumps({"pid": os.getpid()}))
    pod = run_from_tree(root, f"{PODVM}/{name}")
    lines: list[str] = []
    restarts: list[str] = []
    try:
        install.uninstall(str(root), restart=lambda: restarts.append("uninstall"),
                          say=lines.append)
        assert restarts == ["uninstall"]
        assert sorted(p.name for p in (root / "opt/podvm").iterdir()) == \
            sorted([trees.RETIRED, "current", name])
        # containerd finds the pod's shim again through the link (1.6 resolves the
        # binary when it reloads its tasks); no new podvm pod: the runtime is gone
        assert os.readlink(root / "usr/local/bin/containerd-shim-podvm-v2") == install.SHIM
        assert not (root / dropin.DROPIN.lstrip("/")).exists()
        said = [line for line in lines if line.startswith("running podvm pods keep")]
        assert len(said) == 1 and f"{PODVM}/{name}" in said[0], lines
        # while the process runs, a shim exiting beside it leaves the tree
        assert collect_retired_in_a_child(root) == []
        assert (root / "opt/podvm" / name).is_dir()
    finally:
        pod.kill()
        pod.wait()
    assert collect_retired_in_a_child(root) == [name]
    state.joinpath("shim.json").unlink()
    for path in (state, state.parent, state.parent.parent):
        path.rmdir()
    assert snapshot(root) == before


def test_installed_again_after_an_uninstall_under_a_running_pod(tmp_path) -> None:
    """The note an uninstall under running pods left goes back into the record: the
    next uninstall, with no pod left, leaves the root as before."""
    root = kvm_root(tmp_path)
    before = snapshot(root)
    a = tree_bundle(tmp_path, "a")
    name = hostfiles.tree_name(str(a))
    install.install(str(root), str(a), restart=lambda: None, version_text=V16,
                    say=lambda line: None)
    pod = run_from_tree(root, f"{PODVM}/{name}")
    try:
        install.uninstall(str(root), restart=lambda: None, say=lambda line: None)
        assert (root / "opt/podvm" / trees.RETIRED).is_file()
        install.install(str(root), str(a), restart=lambda: None, version_text=V16,
                        say=lambda line: None)
        assert not (root / "opt/podvm" / trees.RETIRED).exists()
        record = hostfiles.load(str(root))
        assert install.SHIM_LINK in record.files
        assert record.directories[:2] == ["/opt", PODVM]
    finally:
        pod.kill()
        pod.wait()
    install.uninstall(str(root), restart=lambda: None, say=lambda line: None)
    assert snapshot(root) == before


def collect_retired_in_a_child(root: pathlib.Path) -> list[str]:
    """treegc.collect_retired as a shim's daemon runs it on its way out (its lock lasts
    until its process ends)."""
    out = subprocess.run([sys.executable, "-c", "import json, sys\n"
                          "from podvm_core import treegc\n"
                          "print(json.dumps(treegc.collect_retired(sys.argv[1])))", str(root)],
                         capture_output=True, text=True, check=True, cwd=REPO_ROOT)
    return json.loads(out.stdout)


def test_an_install_before_versioned_trees_is_replaced_only_without_pods(tmp_path) -> None:
    """The flat layout (the bundle right in /opt/podvm, the link to its bin/): its shims
    run from the very paths an upgrade replaces, so it refuses while one runs; without,
    the flat files go and the tree takes their place."""
    root = kvm_root(tmp_path)
    a = tree_bundle(tmp_path, "a")
    opt, name, state = make_flat(root, a)
    link = root / "usr/local/bin/containerd-shim-podvm-v2"
    flat = snapshot(root)
    with pytest.raises(Refusal, match="this once"):
        install.install(str(root), str(a), restart=lambda: None, version_text=V16,
                        say=lambda line: None)
    assert snapshot(root) == flat
    (state / "shim.json").unlink()
    install.install(str(root), str(a), restart=lambda: None, version_text=V16,
                    say=lambda line: None)
    assert sorted(p.name for p in opt.iterdir()) == sorted([".installed", "current", name])
    assert os.readlink(link) == install.SHIM


def test_an_install_before_versioned_trees_is_uninstalled_only_without_pods(
        tmp_path) -> None:
    root = kvm_root(tmp_path)
    before = snapshot(root)
    _, _, state = make_flat(root, tree_bundle(tmp_path, "a"))
    flat = snapshot(root)
    with pytest.raises(Refusal, match="1 podvm pod"):
        install.uninstall(str(root), restart=lambda: None, say=lambda line: None)
    assert snapshot(root) == flat
    for path in (state / "shim.json", state, state.parent, state.parent.parent):
        path.unlink() if path.is_file() else path.rmdir()
    install.uninstall(str(root), restart=lambda: None, say=lambda line: None)
    assert snapshot(root) == before


def make_flat(root: pathlib.Path, bundle: pathlib.Path
              ) -> tuple[pathlib.Path, str, pathlib.Path]:
    """`bundle` installed as an earlier podvm-node did (its files right in /opt/podvm,
    not recording /opt/podvm), with a live shim's state; /opt/podvm, the tree's name
    and the state directory."""
    install.install(str(root), str(bundle), restart=lambda: None, version_text=V16,
                    say=lambda line: None)
    opt = root / "opt/podvm"
    name = os.readlink(opt / "current")
    (opt / "current").unlink()
    for entry in (opt / name).iterdir():
        entry.rename(opt / entry.name)
    (opt / name).rmdir()
    record = hostfiles.load(str(root))
    record.directories.remove(PODVM)
    hostfiles.save(record, str(root) + hostfiles.RECORD)
    link = root / "usr/local/bin/containerd-shim-podvm-v2"
    link.unlink()
    link.symlink_to(install.FLAT_SHIM)
    state = root / "run/podvm/k8s.io/abc"
    state.mkdir(parents=True)
    (state / "shim.json").write_text(json.dumps({"pid": os.getpid()}))
    return opt, name, state


def test_a_trees_paths_resolve_into_it(monkeypatch) -> None:
    """The configuration's /opt/podvm/bin/... (and current/...) paths name the caller's
    own tree; a process outside a tree (a checkout) keeps them."""
    tree = f"{PODVM}/abc123"
    assert trees.resolve(f"{PODVM}/bin/qemu-system-x86_64", tree) == \
        f"{tree}/bin/qemu-system-x86_64"
    assert trees.resolve(f"{PODVM}/current/share/podvm/vmlinux", tree) == \
        f"{tree}/share/podvm/vmlinux"
    assert trees.resolve(f"{PODVM}/def456/bin/mke2fs", tree) == f"{PODVM}/def456/bin/mke2fs"
    assert trees.resolve("/usr/bin/qemu-system-x86_64", tree) == "/usr/bin/qemu-system-x86_64"
    assert trees.own() is None  # the tests run from a checkout
    monkeypatch.setattr(trees, "own", lambda: tree)
    q = shim_config.parse({"hypervisor": {"qemu": {
        "path": f"{PODVM}/bin/qemu-system-x86_64", "kernel": "/boot/vmlinux",
        "scratch_mke2fs": f"{PODVM}/bin/mke2fs"}}}, "test").qemu
    assert (q.path, q.kernel, q.scratch_mke2fs) == \
        (f"{tree}/bin/qemu-system-x86_64", "/boot/vmlinux", f"{tree}/bin/mke2fs")


def test_containerd_version_from_the_hosts_binary(tmp_path) -> None:
    require_tool("containerd", "containerd")
    assert dropin.parse_version(hostcheck.containerd_version_text("")) == (1, 6)
    assert hostcheck.containerd_version_text(str(scratch_root(tmp_path, None))) is None


def test_not_in_a_cluster_no_label() -> None:
    assert nodelabel.set_label("installed", env={}) == \
        "not in a Kubernetes cluster: no node to label"


def test_delete_runs_the_pods_own_trees_shim(tmp_path, monkeypatch) -> None:
    """containerd runs `delete` through the link, so after an upgrade from the new tree:
    for a container whose `start` recorded another tree that is still there, it execs
    that tree's shim with its own arguments; its own tree's, a tree gone, or no record:
    it goes on itself."""
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    old, new = f"{PODVM}/aaaaaa", f"{PODVM}/bbbbbb"
    execs: list[tuple[str, list[str]]] = []
    monkeypatch.setattr(shim_delete.trees, "own", lambda: new)
    monkeypatch.setattr(shim_delete.trees, "tree_of", lambda path: path)
    monkeypatch.setattr(shim_delete.os, "execv",
                        lambda path, argv: execs.append((path, argv)))
    there = {f"{old}/bin/containerd-shim-podvm-v2"}
    monkeypatch.setattr(shim_delete.os.path, "isfile", lambda path: path in there)
    monkeypatch.setattr(shim_delete.sys, "argv", ["/usr/local/bin/containerd-shim-podvm-v2",
                                                  "-id", "x", "delete"])
    shim_delete._own_tree_delete(str(bundle))  # no record (a checkout's start)
    (bundle / trees.TREE_FILE).write_text(new)
    shim_delete._own_tree_delete(str(bundle))  # its own
    assert execs == []
    (bundle / trees.TREE_FILE).write_text(old)
    shim_delete._own_tree_delete(str(bundle))
    assert execs == [(f"{old}/bin/containerd-shim-podvm-v2",
                      [f"{old}/bin/containerd-shim-podvm-v2", "-id", "x", "delete"])]
    there.clear()  # the old tree is gone: the new one deletes
    shim_delete._own_tree_delete(str(bundle))
    assert len(execs) == 1


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

    def restart_keeping_pods(self) -> None:
        """As systemd restarts containerd: its pods' shims keep running, and it finds
        them again (their bundles' address files)."""
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(timeout=20)
        self._log.close()
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
    ctd = installed_containerd(tmp_path, host)
    before = snapshot(host)
    lines: list[str] = []
    try:
        install.install(str(host), str(node_bundle), restart=lambda: ctd._start(30),
                        version_text=containerd_version(), say=lines.append)
        tree = f"{PODVM}/{hostfiles.tree_name(str(node_bundle))}"
        assert os.readlink(host / "opt/podvm/current") == os.path.basename(tree)
        assert (host / "opt/podvm/current/manifest.json").read_bytes() == \
            (node_bundle / "manifest.json").read_bytes()
        assert os.readlink(host / "usr/local/bin/containerd-shim-podvm-v2") == \
            f"{PODVM}/current/bin/containerd-shim-podvm-v2"
        crictl, configs = cri_setup(ctd, tmp_path)
        pod_id, cid = start_pod(ctd, crictl, configs, "installed")
        try:
            check_pod_runs_from(crictl, pod_id, cid, tree)
        finally:
            remove_pod(crictl, pod_id)
        assert [p.name for p in (tmp_path / "scratch").glob("blank-*")] == \
            [scratchdisk.blank_name()]
        install.uninstall(str(host), restart=ctd.restart, say=lines.append)
        info = crictl.run("info").json()["config"]
        assert "podvm" not in info["containerd"]["runtimes"]
        assert "runc" in info["containerd"]["runtimes"]
    finally:
        ctd.stop()
        assert ctd.forced == [], ctd.forced
    assert snapshot(host) == before, lines


def test_upgrade_under_a_running_pod(tmp_path, node_bundle) -> None:
    """Issue 46's upgrade: a pod started under version A; B installed (containerd
    restarted, the pod untouched); the pod still execs, and is stopped and deleted by
    A's shim, from A's tree; a new pod runs B; A's tree is gone once A's shim is (the
    next install collects it); uninstall leaves the scratch root as it was."""
    require_tool("containerd", "containerd")
    host = tmp_path / "host"
    ctd = installed_containerd(tmp_path, host)
    b_bundle = tmp_path / "bundle-b"  # the same files, another build: another tree
    subprocess.run(["cp", "-a", "--sparse=always", str(node_bundle), str(b_bundle)],
                   check=True)
    (b_bundle / "inputs.sha256").write_text("b\n" + (node_bundle / "inputs.sha256").read_text())
    tree_a = f"{PODVM}/{hostfiles.tree_name(str(node_bundle))}"
    tree_b = f"{PODVM}/{hostfiles.tree_name(str(b_bundle))}"
    assert tree_a != tree_b
    before = snapshot(host)
    lines: list[str] = []
    version = containerd_version()
    try:
        install.install(str(host), str(node_bundle), restart=lambda: ctd._start(30),
                        version_text=version, say=lines.append)
        crictl, configs = cri_setup(ctd, tmp_path)
        old_pod, old_c = start_pod(ctd, crictl, configs, "under-a")
        try:
            check_pod_runs_from(crictl, old_pod, old_c, tree_a)
            shim_a = shim_pids(tree_a)
            assert shim_a, "no process of A's tree"
            install.install(str(host), str(b_bundle), restart=ctd.restart_keeping_pods,
                            version_text=version, say=lines.append)
            assert os.readlink(host / "opt/podvm/current") == os.path.basename(tree_b)
            assert any(line.startswith("kept for their running pods: "
                                       f"{os.path.basename(tree_a)}") for line in lines)
            # the old pod: still there, still A's
            check_pod_runs_from(crictl, old_pod, old_c, tree_a)
        finally:
            remove_pod(crictl, old_pod)
        wait_for("A's shim to exit", lambda: not shim_pids(tree_a), 60)
        new_pod, new_c = start_pod(ctd, crictl, configs, "under-b")
        try:
            check_pod_runs_from(crictl, new_pod, new_c, tree_b)
        finally:
            remove_pod(crictl, new_pod)
        install.install(str(host), str(b_bundle), restart=ctd.restart_keeping_pods,
                        version_text=version, say=lines.append)
        assert f"removed trees no process uses any more: {os.path.basename(tree_a)}" \
            in lines, lines
        assert sorted(p.name for p in (host / "opt/podvm").iterdir()) == \
            sorted([".installed", "current", os.path.basename(tree_b)])
        install.uninstall(str(host), restart=ctd.restart, say=lines.append)
    finally:
        ctd.stop()
        assert ctd.forced == [], ctd.forced
    assert snapshot(host) == before, lines


def shim_pids(tree: str) -> list[int]:
    return treegc.users([tree])[tree]


def containerd_version() -> str:
    return subprocess.run(["containerd", "--version"], capture_output=True, text=True).stdout


def installed_containerd(tmp_path: pathlib.Path, host: pathlib.Path) -> InstalledContainerd:
    """The private containerd and the scratch root as the operator had them: their
    config.toml, a podvm configuration naming the flat layout's paths (which a shim
    takes from its own tree), a scratch path of its own (the bundle's mke2fs makes the
    blank)."""
    ctd = InstalledContainerd(tmp_path / "containerd", host)
    if not bridgenet.missing_prerequisites():
        ctd.network = bridgenet.create(ctd.cni_dir)
        bridgenet.write_conflist(ctd.network, ctd.cni_dir / "net.d")
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
    return ctd


def cri_setup(ctd: InstalledContainerd, tmp_path: pathlib.Path) -> tuple[Crictl, pathlib.Path]:
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
    return crictl, configs


def start_pod(ctd: InstalledContainerd, crictl: Crictl, configs: pathlib.Path,
              name: str) -> tuple[str, str]:
    pod_file = write_config(configs, f"{name}.json", pod_config(ctd, configs, name))
    pod_id = crictl.runp(pod_file, runtime="podvm")
    try:
        cfile = write_config(configs, f"{name}-c.json",
                             container_config("c", "echo hi; sleep 600"))
        cid = crictl.create(pod_id, cfile, pod_file)
        crictl.start(cid)
    except BaseException:
        remove_pod(crictl, pod_id)
        raise
    return pod_id, cid


def remove_pod(crictl: Crictl, pod_id: str) -> None:
    crictl.run("stopp", pod_id, check=False)
    crictl.run("rmp", pod_id, check=False)


def check_pod_runs_from(crictl: Crictl, pod_id: str, cid: str, tree: str) -> None:
    """The pod execs; its QEMU is `tree`'s, with that tree's firmware, loader and
    guest, and maps nothing from outside it."""
    assert crictl.exec(cid, "echo", "from-the-vm").stdout.strip() == "from-the-vm"
    qemu, = wait_for("the pod's QEMU", lambda: pod_qemus(pod_id))
    assert os.readlink(f"/proc/{qemu}/exe") == f"{tree}/bin/qemu-system-x86_64"
    argv = pathlib.Path(f"/proc/{qemu}/cmdline").read_bytes().split(b"\0")
    assert argv[argv.index(b"-bios") + 1] == f"{tree}/share/qemu/qboot.rom".encode()
    files = {line.split()[-1] for line in
             pathlib.Path(f"/proc/{qemu}/maps").read_text().splitlines()
             if len(line.split()) == 6 and line.split()[-1].startswith("/")}
    assert files and all(f.startswith(tree + "/") or f.startswith("/memfd:")
                         for f in files), files
    assert f"{tree}/share/podvm/rootfs.img" in files
    assert f"{tree}/lib/ld.so" in files


def test_uninstall_under_a_running_pod_and_its_last_shim_removes_the_rest(
        tmp_path, node_bundle) -> None:
    """Uninstall while a podvm pod runs: the runtime is gone from containerd (no new
    podvm pod), the pod still execs and is stopped and deleted by its shim, from its tree,
    which that shim removes as it exits, with `current` and the shim's link: the scratch
    root is as it was."""
    require_tool("containerd", "containerd")
    host = tmp_path / "host"
    ctd = installed_containerd(tmp_path, host)
    tree = f"{PODVM}/{hostfiles.tree_name(str(node_bundle))}"
    before = snapshot(host)
    lines: list[str] = []
    try:
        install.install(str(host), str(node_bundle), restart=lambda: ctd._start(30),
                        version_text=containerd_version(), say=lines.append)
        crictl, configs = cri_setup(ctd, tmp_path)
        pod, c = start_pod(ctd, crictl, configs, "uninstalled-under")
        try:
            install.uninstall(str(host), restart=ctd.restart_keeping_pods, say=lines.append)
            assert any(line.startswith("running podvm pods keep their shims' trees")
                       for line in lines), lines
            assert "podvm" not in crictl.run("info").json()["config"]["containerd"]["runtimes"]
            check_pod_runs_from(crictl, pod, c, tree)
        finally:
            remove_pod(crictl, pod)
        wait_for("the shim to exit", lambda: not shim_pids(tree), 60)
        opt = host / "opt/podvm"
        wait_for("its tree to go", lambda: not list(opt.iterdir()), 10)
        assert not os.path.lexists(host / "usr/local/bin/containerd-shim-podvm-v2")
        # the shim's /opt and /opt/podvm are this test's mount points (a node's are plain
        # directories, which it removes too)
        opt.rmdir()
        opt.parent.rmdir()
    finally:
        ctd.stop()
        assert ctd.forced == [], ctd.forced
    assert snapshot(host) == before, lines
