"""containerd starts and drives our shim through `ctr run --runtime io.containerd.podvm.v2`."""
from __future__ import annotations

import os

from shim import paths

from .containerd import mounts_under, podvm_shims


def leftovers(containerd, container_id: str) -> list[str]:
    found = []
    shims = [s for s in podvm_shims() if containerd.address in s]
    if shims:
        found.append(f"shim processes: {shims}")
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
    found += [f"mount {m}" for m in mounts_under(containerd.workdir)
              if container_id in m]
    return found


def test_ctr_run_reaches_the_shim_and_cleans_up(containerd, image_cache) -> None:
    image = containerd.import_busybox(image_cache)
    result = containerd.ctr("run", "--rm", "--runtime", "io.containerd.podvm.v2", image,
                            "ctr-run-1", "true", check=False)
    stderr = result.stderr.decode()
    # containerd started the shim, read its address, called Create and relayed our answer.
    assert result.returncode != 0
    assert "kernel /usr/share/podvm/vmlinux does not exist" in stderr, stderr
    log = containerd.log()
    assert "serving containerd.task.v2.Task" in log  # the daemon's own log, via the FIFO
    assert "ctr-run-1" not in containerd.ctr("containers", "ls", "-q").stdout.decode()
    assert leftovers(containerd, "ctr-run-1") == []


def test_repeated_runs_leave_nothing(containerd, image_cache) -> None:
    image = containerd.import_busybox(image_cache)
    for i in range(3):
        result = containerd.ctr("run", "--rm", "--runtime", "io.containerd.podvm.v2", image,
                                f"again-{i}", "true", check=False)
        assert b"does not exist" in result.stderr
        assert leftovers(containerd, f"again-{i}") == []
