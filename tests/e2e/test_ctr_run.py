"""containerd runs a container in a VM through `ctr run --runtime io.containerd.podvm.v2`."""
from __future__ import annotations

import json
import os

import pytest

from shim.host import paths
from testbed.containerd import mounts_under, podvm_shims
from testbed.pods import pod_qemus
from testbed.vmconfig import GUEST, write_test_config

from .test_crictl import wait_for


@pytest.fixture(scope="module")
def tcg_config(tmp_path_factory):
    return write_test_config(tmp_path_factory.mktemp("ctr-run") / "podvm.toml")


def leftovers(containerd, container_id: str) -> list[str]:
    found = []
    shims = [s for s in podvm_shims() if containerd.address in s]
    if shims:
        found.append(f"shim processes: {shims}")
    found += [f"qemu {pid}" for pid in pod_qemus(container_id)]
    sock = paths.socket_path(paths.socket_address(containerd.address, containerd.namespace,
                                                  container_id))
    if os.path.exists(sock):
        found.append(f"socket {sock}")
    if os.path.exists(paths.state_dir(containerd.namespace, container_id)):
        found.append(f"state {paths.state_dir(containerd.namespace, container_id)}")
    bundle = containerd.state / "io.containerd.runtime.v2.task" / containerd.namespace / \
        container_id
    if bundle.exists():
        found.append(f"bundle {bundle}")
    found += [f"mount {m}" for m in mounts_under(containerd.workdir) if container_id in m]
    return found


def test_ctr_run_in_a_vm(containerd, image_cache, tcg_config) -> None:
    image = containerd.import_busybox(image_cache)
    result = containerd.ctr("run", "--rm", "--runtime", "io.containerd.podvm.v2",
                            "--runtime-config-path", str(tcg_config), image, "ctr-run-1",
                            "sh", "-c", "echo hello from $(uname -r); exit 7", check=False)
    kernel = json.loads((GUEST / "manifest.json").read_text())["kernel_release"]
    assert result.stdout.decode() == f"hello from {kernel}\n", result.stderr
    assert result.returncode == 7
    assert "serving containerd.task.v2.Task" in containerd.log()  # the shim's log, via FIFO
    assert "ctr-run-1" not in containerd.ctr("containers", "ls", "-q").stdout.decode()
    wait_for("the shim to exit and clean up", lambda: leftovers(containerd, "ctr-run-1") == [])


def test_ctr_run_with_a_missing_kernel_fails_clearly(containerd, image_cache, tmp_path) -> None:
    image = containerd.import_busybox(image_cache)
    bad = write_test_config(tmp_path / "bad.toml", kernel="/nonexistent/vmlinux")
    result = containerd.ctr("run", "--rm", "--runtime", "io.containerd.podvm.v2",
                            "--runtime-config-path", str(bad), image, "ctr-run-2", "true",
                            check=False)
    assert result.returncode != 0
    assert "kernel /nonexistent/vmlinux does not exist" in result.stderr.decode()
    assert str(bad) in result.stderr.decode()
    wait_for("the shim to exit and clean up", lambda: leftovers(containerd, "ctr-run-2") == [])
