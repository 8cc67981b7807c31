"""A node's reboot under a running podvm pod (issue 46): power lost while the pod runs a
container and its shim makes its shape's template, then what a boot does not bring back
removed (testbed/reboot.py says exactly what and why), and containerd started again on the
same root. Kubelet then stops and removes the sandbox containerd's metadata still names;
new pods of the same shape and of the killed template's shape run, exec, stop and are
removed; and nothing of any of them is left: no process, mount, cgroup, state file,
socket, jail-id claim, scratch file or half-made template. The template made before the
power went is used again, checked as every restore checks it (docs/design.md 8.4).

Real containerd (Debian's 1.6) and QEMU under TCG: three pods boot (the old pod, the new
shape's and, before them, the default shape's template)."""
from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
import sys
import subprocess
import uuid

import pytest

from shim.host import paths
from shim.resources.annotations import KATA
from shim.vm.template.store import MAKING_FILE
from testbed import cgroupdirs, reboot
from testbed.containerd import CRI_NAMESPACE, SHIM_BIN_DIR, Containerd
from testbed.cri import Crictl, write_config
from testbed.pods import container_config, pod_config, podvm_leftovers, qemus

from .test_crictl import wait_for
from .test_podvm_pods import cri_containerd, remove_pod

NEW_SHAPE = {KATA + "default_memory": "259"}
"""A pod of a shape no template has (the memory's remainder modulo 128 MiB)."""


@pytest.fixture(scope="module")
def node(tmp_path_factory, image_cache, pod_network):
    workdir = tmp_path_factory.mktemp("reboot-store")
    template_cgroup = f"/podvm-test-reboot-{uuid.uuid4().hex[:12]}"
    try:
        for c in cri_containerd(tmp_path_factory, image_cache, "reboot", "podvm-reboot-test",
                                template_path=str(workdir / "store"),
                                template_cgroup=template_cgroup,
                                enable_annotations=("default_vcpus", "default_memory")):
            yield {"ctd": c, "store": workdir / "store", "scratch": workdir / "store-scratch",
                   "template_cgroup": template_cgroup, "configs": workdir / "configs"}
    finally:
        cgroupdirs.remove_cgroup(template_cgroup)


def runp(crictl: Crictl, node: dict, name: str, **extra) -> tuple[str, pathlib.Path]:
    pod_file = write_config(node["configs"], f"pod-{name}.json",
                            pod_config(node["ctd"], node["configs"], name, **extra))
    return crictl.runp(pod_file, runtime="podvm"), pod_file


def run_container(crictl: Crictl, node: dict, pod: str, pod_file: pathlib.Path,
                  name: str) -> str:
    cfile = write_config(node["configs"], f"{name}-c.json",
                         container_config(name, "echo up; sleep 1000"))
    cid = crictl.create(pod, cfile, pod_file)
    crictl.start(cid)
    r = crictl.exec(cid, "cat", "/proc/sys/kernel/random/boot_id", timeout=60)
    assert r.exit_code == 0 and r.stdout.strip(), r
    return cid


def making_files(store: pathlib.Path) -> list[str]:
    """A template's files while (or because) a maker was writing them."""
    return sorted(n for n in os.listdir(store) if MAKING_FILE.fullmatch(n) or
                  n.endswith(".tmp"))


def template_keys(store: pathlib.Path) -> set[str]:
    return {p.stem for p in store.glob("*.json")}


def template_vm(pod: str) -> int | None:
    name = f"podvm-{pod}-template".encode()
    for pid in qemus():
        try:
            if name in pathlib.Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
        except OSError:
            continue
    return None


def shim_said(ctd: Containerd, pod: str, pattern: str) -> bool:
    return any(pod in line and re.search(pattern, line) for line in ctd.log().splitlines())


def shim_delete(ctd: Containerd, pod: str) -> int:
    """containerd's `delete` of the sandbox container `pod` (its bundle in the state
    directory, which /run held); its exit status, once it printed a DeleteResponse."""
    bundle = ctd.state / "io.containerd.runtime.v2.task" / CRI_NAMESPACE / pod
    done = subprocess.run([str(SHIM_BIN_DIR / "containerd-shim-podvm-v2"), "-namespace",
                           CRI_NAMESPACE, "-address", ctd.address, "-publish-binary",
                           "/usr/bin/containerd", "-id", pod, "-bundle", str(bundle),
                           "delete"], capture_output=True, timeout=60)
    assert done.stdout, done.stderr.decode(errors="replace")  # the DeleteResponse
    return done.returncode


@contextlib.contextmanager
def throttled(cgroup: str):
    """The processes below `cgroup` (cgroup v1) given 1% of a CPU in the block (its CFS
    quota): a template being made there stays half made."""
    quota = pathlib.Path("/sys/fs/cgroup/cpu", cgroup.strip("/"), "cpu.cfs_quota_us")
    quota.write_text(str(THROTTLED_QUOTA_US))
    try:
        yield
    finally:
        quota.write_text("-1")


THROTTLED_QUOTA_US = 1000
"""Of the default 100 ms period."""


def warm(config: str) -> None:
    done = subprocess.run([sys.executable, "-m", "podvmctl.cli", "templates", "warm",
                           "--config", config], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr


def test_a_node_reboot_leaves_nothing_stale_and_blocks_no_pod(node) -> None:
    ctd, store = node["ctd"], node["store"]
    node["configs"].mkdir()
    crictl = Crictl(ctd.cri_endpoint, timeout="180s")
    warm(ctd.podvm_config)  # as the installer does: the default shape's template
    kept = template_keys(store)
    assert len(kept) == 1, kept

    # Before: a pod of a new shape runs a container while its shim makes the shape's
    # template, which it starts as the pod's boot ends. The template is held half made
    # until the power goes, whatever the machine's speed: it was made in 11 s once, before
    # the container ran, and the test found nothing to catch it making.
    old, old_file = runp(crictl, node, "before", annotations=NEW_SHAPE)
    wait_for("the template's VM", lambda: template_vm(old), timeout=120)
    wait_for("the template's files", lambda: making_files(store), timeout=60)
    with throttled(node["template_cgroup"]):
        run_container(crictl, node, old, old_file, "before")
        netns = reboot.network_namespace(crictl, old)
        assert template_vm(old) and making_files(store), "the template was made meanwhile"

    killed = reboot.power_loss(ctd, [old])
    assert len(killed) >= 4, killed  # containerd, the shim, the pod's QEMU and template's
    half_made = making_files(store)
    assert half_made and template_keys(store) == kept, os.listdir(store)
    removed = reboot.boot(ctd, [old], [netns], node["template_cgroup"])
    # what the pod had in /run and the kernel was there to go (testbed/reboot.py)
    assert f"network namespace {netns}" in removed, removed
    assert f"directory {paths.state_dir(CRI_NAMESPACE, old)}" in removed, removed
    for kind in ("cgroup ", "jail-id claim ", "mount "):
        assert any(r.startswith(kind) for r in removed), (kind, removed)

    # containerd 1.6 runs no `shim delete` after a reboot (the tasks' bundles went with
    # /run: it loads no shim, its CRI finds the task gone; seen in its log). One run as
    # it would be, with the bundle and podvm's state gone, still answers and exits 0
    assert shim_delete(ctd, old) == 0

    ctd.start()  # the same root: its metadata names the old sandbox and container
    assert old in crictl.pods(), "containerd forgot the sandbox"
    remove_pod(crictl, old)  # what kubelet does with a sandbox that is not ready
    assert old not in crictl.pods()
    assert podvm_leftovers(ctd, old) == []

    # After: the default shape, restored from the template made before the power went
    again, again_file = runp(crictl, node, "after")
    run_container(crictl, node, again, again_file, "after")
    assert shim_said(ctd, again, rf"VM restored from template {next(iter(kept))}"), \
        "the template from before the reboot was not restored"
    # and the shape whose template was half made: the pod boots, its shim makes it
    fresh, fresh_file = runp(crictl, node, "fresh", annotations=NEW_SHAPE)
    run_container(crictl, node, fresh, fresh_file, "fresh")
    wait_for("the new shape's template", lambda: len(template_keys(store)) == 2,
             timeout=300)
    wait_for("its maker's end", lambda: shim_said(ctd, fresh, "in the background"),
             timeout=60)
    for pod in (again, fresh):
        remove_pod(crictl, pod)
    for pod in (old, again, fresh):
        wait_for(f"nothing of {pod} left", lambda: podvm_leftovers(ctd, pod) == [],
                 timeout=60)
    assert making_files(store) == [], os.listdir(store)
    assert reboot.claims_of([old, again, fresh]) == []
    made = json.loads((store / f"{(template_keys(store) - kept).pop()}.json").read_text())
    assert made["made_by"] == fresh
    # the blank file system (its size and mke2fs arguments in its name) and the lock only
    scratch = os.listdir(node["scratch"]) if node["scratch"].exists() else []
    assert all(re.fullmatch(r"blank-\d+M-[0-9a-f]+\.ext4|\.lock", n) for n in scratch), \
        scratch
    # no template cgroup left, but the page cache's (shim/vm/template/cache.py), which stays
    assert [c for c in cgroupdirs.cgroups_below(node["template_cgroup"])
            if os.path.basename(c) != node["template_cgroup"].strip("/")
            and "/podvm_templates-cache" not in c] == []
    assert [c for c in cgroupdirs.cgroups_below(ctd.cgroup_parent)
            if any(pod in c for pod in (old, again, fresh))] == []

