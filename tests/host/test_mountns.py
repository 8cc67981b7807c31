"""The pod's own mount namespace (shim/host/mountns.py), in a real process that makes one as
`start` does: its binds are never the host's mountpoints, they see the host's mounts made
after it (even where the host's / is private), and cleanup reaches into it."""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from shim.host import cleanup, mounts
from testbed.prereqs import require_root

# A process in the pod's namespace: it shares what it is told to (shim/host/share.py), answers
# with what it sees.
_POD = """
import json, os, sys
from shim.host import mountns, mounts
from shim.host.share import Share
mountns.unshare_for_pod()
print(json.dumps({"ns": os.readlink("/proc/self/ns/mnt")}), flush=True)
shares = {}
for line in sys.stdin:
    state, container, source, name, readonly, from_host = json.loads(line)
    share = shares.get(state)
    if share is None:
        share = shares[state] = Share(state)
        share.create()
    if from_host:  # a volume; the rootfs an empty directory of the host's
        rootfs = os.path.join(state, "rootfs-" + container)
        os.makedirs(rootfs)
        share.add(container, rootfs, True, [(source, name, readonly, False)])
        target = os.path.join(share.tree, container, "mounts", name)
    else:  # a rootfs: what the shim mounts itself, in the pod's namespace
        mounts.mount(mounts.Mount("tmpfs", "tmpfs", ("size=1m",)), source)
        open(os.path.join(source, "top"), "w").write("own\\n")
        share.add(container, source, False, [])
        target = os.path.join(share.tree, container, "rootfs")
    below = [[s.path, list(s.options)] for s in mounts.submounts(source)]
    points = [l.split()[4] for l in open("/proc/self/mountinfo")]
    seen = {}
    for path in ("top", "cache/note"):
        try:
            seen[path] = open(os.path.join(target, path)).read()
        except OSError as exc:
            seen[path] = exc.strerror
    print(json.dumps({"points": points, "seen": seen, "submounts": below}), flush=True)
"""


def host_points() -> list[str]:
    return [line.split()[4] for line in open("/proc/self/mountinfo")]


@pytest.fixture
def pod():
    require_root()
    proc = subprocess.Popen([sys.executable, "-c", _POD], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, cwd=pathlib.Path(__file__)
                            .parents[2])
    try:
        hello = json.loads(proc.stdout.readline())
        assert hello["ns"] != os.readlink("/proc/self/ns/mnt")
        yield proc
    finally:
        proc.kill()
        proc.wait()


def ask(proc, *request) -> dict:
    proc.stdin.write(json.dumps(request) + "\n")
    proc.stdin.flush()
    line = proc.stdout.readline()
    assert line, "the pod's process died"
    return json.loads(line)


def test_a_volume_s_submount_can_go_while_the_pod_binds_it(pod, tmp_path) -> None:
    """critest's read-only mount specs: a tmpfs at HOSTPATH/tmpfs mounted after the pod
    started, HOSTPATH bound read-only; while bound, the host unmounts the tmpfs (lazily)
    and removes HOSTPATH: both succeed. Before, the bind shows the host's tree."""
    volume = tmp_path / "volume"
    (volume / "cache").mkdir(parents=True)
    (volume / "top").write_text("top\n")
    mounts.mount(mounts.Mount("tmpfs", "tmpfs", ("size=1m",)), str(volume / "cache"))
    try:
        (volume / "cache" / "note").write_text("in the tmpfs\n")
        target = tmp_path / "state" / "shared" / "c1" / "mounts" / "0-data"
        seen = ask(pod, str(tmp_path / "state"), "c1", str(volume), "0-data", True, True)
        assert seen["seen"] == {"top": "top\n", "cache/note": "in the tmpfs\n"}
        assert seen["submounts"] == [["cache", ["rw"]]]  # the host's, to keep it writable
        assert str(target) in seen["points"] and str(target / "cache") in seen["points"]
        assert str(tmp_path / "state" / "export" / "c1" / "mounts" / "0-data") in \
            seen["points"]  # what QEMU exports
        assert not [p for p in host_points() if p.startswith(str(tmp_path / "state"))]
    finally:
        assert mounts.unmount(str(volume / "cache"))  # MNT_DETACH, as critest's umount
    shutil.rmtree(volume)  # EBUSY when the pod's binds were the host's mountpoints
    assert not volume.exists()


def test_cleanup_unmounts_inside_the_pod_s_namespace_while_it_lives(pod, tmp_path) -> None:
    (tmp_path / "volume").mkdir()
    shared = tmp_path / "state" / "shared"
    seen = ask(pod, str(tmp_path / "state"), "c1", str(tmp_path / "volume"), "", False, False)
    assert str(shared / "c1" / "rootfs") in seen["points"]
    assert seen["seen"]["top"] == "own\n"  # the pod's own mount, not the host's directory
    assert cleanup.pod_mount_process([pod.pid]) == pod.pid
    assert cleanup.unmount_in_pod([str(shared / "c1"), str(tmp_path / "volume")], pod.pid,
                                  "sb") == 2
    with open(f"/proc/{pod.pid}/mountinfo") as f:
        left = f.read()
    assert str(shared / "c1") not in left
    assert str(tmp_path / "state" / "export" / "c1") not in left  # what QEMU exported
    assert cleanup.unmount_in_pod([str(shared / "c1"), str(tmp_path / "volume")], pod.pid,
                                  "sb") == 0  # idempotent
    pod.kill()
    pod.wait()
    assert cleanup.pod_mount_process([pod.pid]) is None


def test_a_process_with_threads_is_refused_clearly() -> None:
    require_root()
    probe = ("import threading, time\n"
             "threading.Thread(target=time.sleep, args=(5,), daemon=True).start()\n"
             "from shim.host import mountns\n"
             "try:\n"
             "    mountns.unshare_for_pod()\n"
             "except mountns.MountNamespaceError as exc:\n"
             "    print(exc)\n")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            timeout=30, check=True)
    assert "single-threaded" in result.stdout and "has 2" in result.stdout, result
