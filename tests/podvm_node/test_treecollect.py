"""`podvm-node trees` (podvm_node/treecollect.py) as the DaemonSet's container runs it,
against a scratch host root that podvm-node install filled: a tree an upgrade left to a
running process stays while it runs and goes at the next collection once it is gone,
without another install; `current`'s tree always stays; and a collector that may not look
into a process (a jailed QEMU runs as another uid: without CAP_SYS_PTRACE its maps are
closed to root) removes nothing rather than a tree that process may use."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from podvm_node import hostfiles, install
from testbed.prereqs import require_root, require_tool

from .test_install import PODVM, V16, kvm_root, run_from_tree, tree_bundle

NOBODY = 65534
ROOT = pathlib.Path(__file__).resolve().parents[2]


def collect(root: pathlib.Path, *wrapper: str) -> str:
    """One `podvm-node trees --once` on `root`, through `wrapper` (a command that runs
    it); what it said."""
    done = subprocess.run([*wrapper, sys.executable, "-m", "podvm_node.cli", "trees",
                           f"--host-root={root}", "--once"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture
def upgraded(tmp_path):
    """A root with A installed, then B over it: (root, A's name, B's name)."""
    root = kvm_root(tmp_path)
    a, b = tree_bundle(tmp_path, "a"), tree_bundle(tmp_path, "b")
    install.install(str(root), str(a), restart=lambda: None, version_text=V16,
                    say=lambda _: None)
    return root, hostfiles.tree_name(str(a)), b


def test_a_tree_left_to_a_running_process_goes_once_it_is_gone(upgraded) -> None:
    root, name_a, b = upgraded
    opt = root / PODVM.lstrip("/")
    pod = run_from_tree(root, f"{PODVM}/{name_a}")
    try:
        install.install(str(root), str(b), restart=lambda: None, version_text=V16,
                        say=lambda _: None)
        name_b = hostfiles.tree_name(str(b))
        assert collect(root) == ""
        assert (opt / name_a).is_dir() and pod.poll() is None
    finally:
        pod.kill()
        pod.wait()
    assert collect(root) == f"podvm-node trees: removed trees no process uses any more: " \
                            f"{name_a}\n"
    assert sorted(p.name for p in opt.iterdir()) == sorted([".installed", "current", name_b])
    assert collect(root) == ""  # current's tree stays, unused as it is


def test_a_process_it_may_not_look_into_keeps_every_tree(tmp_path) -> None:
    """The robustness case, on a /proc laid out as the kernel's (this machine's kernel
    lets root read any process's maps, so a real closed one cannot be made here): a
    process of another uid whose exe, cwd and maps the collector may not read (a jailed
    QEMU's, to a collector without CAP_SYS_PTRACE; here files it may not read, the
    collector run without CAP_DAC_OVERRIDE) uses every tree; one of its own uid that a
    security module closes uses none. On the code before, both used nothing, and the
    tree under the running QEMU was removed."""
    require_root()
    require_tool("setpriv", "util-linux")
    proc = tmp_path / "proc"
    for pid, uid in ((4242, NOBODY), (4243, 0)):
        entry = proc / str(pid)
        entry.mkdir(parents=True)
        (entry / "maps").write_text("")
        (entry / "maps").chmod(0)
        os.symlink("/nowhere", entry / "exe")
        os.symlink("/", entry / "cwd")
        os.chown(entry / "maps", uid, uid)
        os.chown(entry, uid, uid, follow_symlinks=False)
    (proc / "4243").chmod(0o500)
    trees = ["/opt/podvm/a1b2c3", "/opt/podvm/d4e5f6"]
    done = subprocess.run(
        ["setpriv", "--inh-caps=-dac_override,-dac_read_search",
         "--bounding-set=-dac_override,-dac_read_search", sys.executable, "-c",
         "import json, sys\nfrom podvm_core import treegc\n"
         "print(json.dumps(treegc.users(sys.argv[2:], proc=sys.argv[1])))", str(proc),
         *trees], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {t: [4242] for t in trees}


def test_bad_arguments_are_refused(tmp_path) -> None:
    for argv in (["--host-root", str(tmp_path), "--every", "0"], ["--every", "5"],
                 ["--host-root", str(tmp_path), "--every", "5", "--once"]):
        done = subprocess.run([sys.executable, "-m", "podvm_node.cli", "trees", *argv],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and "podvm-node trees" in done.stderr, argv
    os.makedirs(tmp_path / "empty")
    assert collect(tmp_path / "empty") == ""  # no /opt/podvm there: nothing to do
