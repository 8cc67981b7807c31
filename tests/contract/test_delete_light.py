"""`delete` is a process containerd runs on every container's way out and kills at 5 s
(issue 47): when the pod's daemon has removed everything, it loads only what finding that
out needs, and answers without protobuf; what is left still goes (shim/contract/delete.py,
shim/host/leftovers.py)."""
from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time

import pytest

from podvm_core.pb.containerd.task.v2 import shim_pb2 as api
from shim.contract.delete import KILLED, delete_response
from shim.host import leftovers, paths
from shim.host.pids import SHIM_BINARY, is_our_shim
from testbed.shimproc import NS, SHIM, make_bundle

HEAVY = ("asyncio", "google.protobuf", "psutil", "ctypes", "cgroups", "shim.host.cleanup",
         "shim.host.podstate", "shim.network", "shim.resources", "shim.config", "tomllib",
         "logging", "subprocess", "secrets", "hashlib", "shutil", "signal", "socket",
         "dataclasses", "typing", "podvm_core.treegc", "json", "re", "enum")
"""What `delete` of a gone pod must not load: each is milliseconds of its CPU."""

PODVM_MODULES = {
    "shim", "shim.contract", "shim.contract.cli", "shim.contract.flags",
    "shim.contract.delete", "shim.contract.wire", "shim.host", "shim.host.paths",
    "shim.host.shimstate", "shim.host.leftovers", "shim.host.pids", "podvm_core",
    "podvm_core.trees", "podvm_core.atomic", "podvm_core.lightjson"}
"""All of podvm that it loads: a module added here is a choice, not a drift."""


def _delete_importing(bundle: pathlib.Path, grpc: str) -> tuple[bytes, set[str]]:
    """`delete` as containerd runs it, under -X importtime: its stdout and the modules it
    imported."""
    result = subprocess.run(
        [sys.executable, "-X", "importtime", SHIM, "-namespace", NS, "-address", grpc,
         "-publish-binary", "/usr/bin/containerd", "-id", bundle.name, "delete"],
        cwd=bundle, capture_output=True, timeout=60, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr.decode()[-3000:]
    loaded = set(re.findall(r"^import time:\s+\d+ \|\s+\d+ \|\s*(\S+)$",
                            result.stderr.decode(), re.M))
    assert "shim.contract.cli" in loaded, result.stderr.decode()[-3000:]
    return result.stdout, loaded


def test_delete_of_a_gone_pod_loads_only_what_it_needs(tmp_path) -> None:
    bundle = make_bundle(tmp_path, "gone-sb", sandbox_id="gone-sb")
    out, loaded = _delete_importing(bundle, str(tmp_path / "containerd.sock"))
    assert api.DeleteResponse.FromString(out).exit_status == 137
    heavy = sorted(m for m in loaded if any(m == h or m.startswith(h + ".") for h in HEAVY))
    assert not heavy, f"`delete` of a gone pod loaded {heavy}"
    ours = {m for m in loaded if m.split(".")[0] in ("shim", "podvm_core", "cgroups")}
    assert ours == PODVM_MODULES, f"podvm modules: {sorted(ours ^ PODVM_MODULES)}"


def test_delete_of_a_workload_container_of_a_gone_pod_is_as_light(tmp_path) -> None:
    bundle = make_bundle(tmp_path, "gone-c1", sandbox_id="gone-sb2")
    out, loaded = _delete_importing(bundle, str(tmp_path / "containerd.sock"))
    assert api.DeleteResponse.FromString(out).exit_status == 137
    assert not {"psutil", "shim.host.cleanup"} & loaded


@pytest.mark.parametrize("exited_at_ns", [0, 1, 999_999_999, 1_000_000_000,
                                          1_765_000_000_123_456_789])
@pytest.mark.parametrize("pid", [0, 1, 4_194_304])
def test_the_hand_written_response_is_protobuf_s(exited_at_ns: int, pid: int) -> None:
    expected = api.DeleteResponse(pid=pid, exit_status=KILLED)
    expected.exited_at.FromNanoseconds(exited_at_ns)
    assert delete_response(KILLED, exited_at_ns, pid) == expected.SerializeToString()


def test_a_mount_left_on_the_rootfs_is_seen_and_removed(tmp_path) -> None:
    """An older podvm mounted a container's rootfs in the host's namespace: with the pod's
    state gone, `delete` still finds that mount (its path has a space and a backslash,
    which mountinfo escapes) and unmounts it. In a mount namespace of the test's own."""
    root = tmp_path / "a b\\c"
    bundle = make_bundle(root, "mounted-sb", sandbox_id="mounted-sb")
    probe = ("import sys; from shim.host.leftovers import left_behind as l; "
             f"print(l('{NS}', 'mounted-sb', sys.argv[1]))")
    script = ('mount --make-rprivate / && mount -t tmpfs podvm-test "$1/rootfs" && '
              f'"{sys.executable}" -c "$2" "$1" && "$3" -namespace {NS} -address "$1/c.sock" '
              '-id mounted-sb delete >/dev/null && '
              '"' + sys.executable + '" -c "$2" "$1" && '
              'if grep -q podvm-test /proc/self/mountinfo; then echo still mounted; fi')
    result = subprocess.run(["unshare", "--mount", "sh", "-c", script, "sh", str(bundle),
                             probe, SHIM], cwd=bundle, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "False"], result.stdout + result.stderr


def test_nothing_is_left_behind_without_state_or_mounts(tmp_path) -> None:
    bundle = make_bundle(tmp_path, "clean-sb", sandbox_id="clean-sb")
    assert not leftovers.left_behind(NS, "clean-sb", str(bundle))
    assert not leftovers.mounted_at_or_under(str(bundle))
    assert leftovers.mounted_at_or_under("/proc")
    assert leftovers.mounted_at_or_under("/")


def test_a_state_directory_is_left_behind(tmp_path) -> None:
    bundle = make_bundle(tmp_path, "c2", sandbox_id="stated-sb")
    state_dir = pathlib.Path(leftovers.paths.state_dir(NS, "stated-sb"))
    state_dir.mkdir(parents=True)
    try:
        assert leftovers.left_behind(NS, "c2", str(bundle))
    finally:
        os.rmdir(state_dir)


@pytest.mark.parametrize("record, left", [
    (None, False),  # the pod never booted: nothing of a container was shared
    ({"rootfs": {"other": "/b/other/rootfs"}}, False),  # unshared by its Delete
    ({"rootfs": {"live-c1": "/b/live-c1/rootfs"}}, True),  # its Delete failed before
    ({"rootfs": "garbled"}, True)])
def test_delete_of_a_workload_container_of_a_live_pod_reads_its_daemon_s_record(
        tmp_path, record, left) -> None:
    """containerd 1.6 runs a workload container's `delete` inside its pod's StopPodSandbox,
    while the pod's daemon still runs. The daemon unshares the container's files before its
    Delete answers, and its record (sandbox.json) then names no rootfs of the container:
    `delete` finds nothing to do without psutil's scan of every process (3.7 s of each of
    twenty pods stopped at once), and leaves the pod's state alone. A record still naming
    it (a Delete that failed first), or one it cannot read, leaves the mounts to `delete`
    (test_process_contract's unmount in the pod's namespace); so does a daemon gone."""
    bundle = make_bundle(tmp_path, "live-c1", sandbox_id="live-sb")
    state_dir = pathlib.Path(leftovers.paths.state_dir(NS, "live-sb"))
    daemon = None
    try:
        state_dir.mkdir(parents=True)
        daemon = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)",
                                   SHIM_BINARY])  # a live process that is "our shim"
        deadline = time.monotonic() + 30  # once it has exec'd (a busy core delays it)
        while not is_our_shim(daemon.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert is_our_shim(daemon.pid)
        (state_dir / "shim.json").write_text(json.dumps({"pid": daemon.pid}))
        if record is not None:
            (state_dir / paths.POD_STATE_FILE).write_text(json.dumps({"version": 1, **record}))
        assert leftovers.left_behind(NS, "live-c1", str(bundle)) == left
        assert leftovers.left_behind(NS, "live-sb", str(make_bundle(
            tmp_path, "live-sb", sandbox_id="live-sb")))  # the pod's own: its state
        if not left:
            out, loaded = _delete_importing(bundle, str(tmp_path / "containerd.sock"))
            assert api.DeleteResponse.FromString(out).exit_status == 137
            heavy = sorted(m for m in loaded
                           if any(m == h or m.startswith(h + ".") for h in HEAVY))
            assert not heavy, f"`delete` of a live pod's container loaded {heavy}"
            assert daemon.poll() is None and (state_dir / "shim.json").exists()
        daemon.kill()
        daemon.wait()
        assert leftovers.left_behind(NS, "live-c1", str(bundle))
    finally:
        if daemon is not None:
            daemon.kill()
            daemon.wait()
        shutil.rmtree(state_dir, ignore_errors=True)
