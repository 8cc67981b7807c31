"""The pod's shared directory (shim/host/share.py) on real mounts, each scenario in a process
with a mount namespace of its own (as the daemon has): what QEMU exports is read-only but
for the containers' roots and read-write volumes, and the shim, playing against a guest
that rewrites its structure as fast as it can, never makes, mounts or removes anything
outside it."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

from shim.host import mounts
from tests.conftest import require_root

ROOT = pathlib.Path(__file__).parents[2]


def in_pod_namespace(script: str, *args: str, timeout: float = 120) -> dict:
    """`script` run by a fresh Python in a new mount namespace (mountns.unshare_for_pod);
    its last line of output, as JSON."""
    require_root()
    prologue = "import json, os, sys\nfrom shim.host import mountns\nmountns.unshare_for_pod()\n"
    result = subprocess.run([sys.executable, "-c", prologue + script, *args], cwd=ROOT,
                            capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


_VIEW = r"""
from shim.host.share import Share
area = sys.argv[1]
volume, hosts, rootfs = (os.path.join(area, n) for n in ("volume", "hosts", "rootfs"))
os.makedirs(rootfs)
open(hosts, "w").write("127.0.0.1 localhost\n")
share = Share(os.path.join(area, "state"))
share.create()
share.add("c1", rootfs, True, [(volume, "0-rw", False, False), (volume, "1-ro", True, False),
                               (volume, "2-rro", True, True), (hosts, "3-hosts", True, False)])
export = share.export
def writes(path):
    try:
        if path.endswith("/"):
            os.mkdir(path + "new-" + path.replace("/", "_"))
        else:
            with open(path, "a") as f:
                f.write("x")
        return "ok"
    except OSError as exc:
        return exc.strerror
seen = {p: writes(export + "/" + p.lstrip("/")) for p in (
    "/", "c1/", "c1/mounts/", "c1/rootfs/", "c1/mounts/0-rw/", "c1/mounts/0-rw/cache/",
    "c1/mounts/1-ro/", "c1/mounts/1-ro/cache/", "c1/mounts/2-rro/", "c1/mounts/2-rro/cache/",
    "c1/mounts/3-hosts", "c1/rootfs")}
flags = {l.split()[4][len(export) + 1:]: l.split()[5] for l in open("/proc/self/mountinfo")
         if l.split()[4].startswith(export + "/")}
share.remove("c1")
left = [l.split()[4] for l in open("/proc/self/mountinfo") if area + "/state" in l]
share.destroy()
gone = [l.split()[4] for l in open("/proc/self/mountinfo") if area + "/state" in l]
print(json.dumps({"seen": seen, "left": left, "gone": gone, "flags": flags,
                  "state": os.listdir(os.path.join(area, "state"))}))
"""


def test_the_guest_writes_only_container_roots_and_writable_volumes(tmp_path) -> None:
    require_root()
    cache = tmp_path / "volume" / "cache"  # a host mount below a volume
    cache.mkdir(parents=True)
    mounts.mount(mounts.Mount("tmpfs", "tmpfs", ("size=1m",)), str(cache))
    try:
        got = in_pod_namespace(_VIEW, str(tmp_path))
    finally:
        mounts.unmount(str(cache))
    erofs = "Read-only file system"
    assert got["seen"] == {
        "/": erofs, "c1/": erofs, "c1/mounts/": erofs,  # the structure the shim walks
        "c1/rootfs/": "ok", "c1/mounts/0-rw/": "ok", "c1/mounts/0-rw/cache/": "ok",
        "c1/mounts/1-ro/": erofs, "c1/mounts/1-ro/cache/": "ok",  # runc's `ro`: top only
        "c1/mounts/2-rro/": erofs, "c1/mounts/2-rro/cache/": erofs,  # `rro`: all of it
        "c1/mounts/3-hosts": erofs,
        "c1/rootfs": "Is a directory"}
    # what QEMU opens for the guest there is never a host device or setuid file
    assert len(got["flags"]) == 8, got["flags"]  # rootfs, 4 binds, 3 volumes' submount
    for point, flags in got["flags"].items():
        assert {"nosuid", "nodev", "noexec"} <= set(flags.split(",")), (point, flags)
    # a container removed: only the two mounts of the share itself are left, then none
    assert sorted(p.rsplit("/", 1)[1] for p in got["left"]) == ["export", "shared"]
    assert got["gone"] == [] and got["state"] == []


# The guest as it would be if it could write the structure (a QEMU exporting `shared/`
# itself): a process swapping every component the shim uses for a symlink to `canary`,
# or a file, in a tight loop, while the shim shares and removes a container 150 times.
_ATTACK = r"""
import errno, signal, time
from shim.host.share import Share
area = sys.argv[1]
canary, volume, hosts, rootfs = (os.path.join(area, n)
                                 for n in ("canary", "volume", "hosts", "rootfs"))
for d in (canary, volume, rootfs):
    os.makedirs(d)
open(hosts, "w").write("hosts\n")
share = Share(os.path.join(area, "state"))
share.create()
tree = share.tree
before = {l.split()[4] for l in open("/proc/self/mountinfo")}
parts = ["c1", "c1/rootfs", "c1/mounts", "c1/mounts/0-vol", "c1/mounts/1-hosts"]
attacker = os.fork()
if attacker == 0:  # as 9p does for the guest: each parent resolved without a symlink
    from shim.host import beneath
    os.setsid()
    root = os.open(tree, os.O_PATH | os.O_DIRECTORY)
    n = 0
    while True:
        n += 1
        for part in parts:
            parent, name = os.path.split(part)
            try:
                at = beneath.open_dir(root, parent, beneath.STRICT) if parent else os.dup(root)
            except OSError:
                continue
            try:
                if n % 3 == 0:  # a directory holding the shim's mounts goes elsewhere
                    os.rename(name, f"{name}.{n}", src_dir_fd=at, dst_dir_fd=at)
                elif n % 3 == 1:
                    os.rmdir(name, dir_fd=at)
                else:
                    os.unlink(name, dir_fd=at)
            except OSError:
                pass
            try:
                os.symlink(canary if n % 2 else "/", name, dir_fd=at)
            except OSError:
                pass
            os.close(at)
        if n % 4 == 0:  # now and then a pause, so that the shim gets further in some rounds
            time.sleep(0.001 * (n % 3))
outcomes, escaped = {}, []
for i in range(150):
    try:
        share.add("c1", rootfs, True, [(volume, "0-vol", False, False),
                                        (hosts, "1-hosts", True, False)])
        outcome = "shared"
    except OSError as exc:
        outcome = errno.errorcode.get(exc.errno, str(exc.errno))
    outcomes[outcome] = outcomes.get(outcome, 0) + 1
    now = {l.split()[4] for l in open("/proc/self/mountinfo")}
    escaped += [p for p in now - before if not p.startswith(share.tree + "/") and
                not p.startswith(share.export + "/")]
    escaped += [os.path.join(canary, n) for n in os.listdir(canary)]
    try:
        share.remove("c1")
    except OSError as exc:
        key = "remove " + errno.errorcode.get(exc.errno, str(exc.errno))
        outcomes[key] = outcomes.get(key, 0) + 1
os.kill(attacker, signal.SIGKILL)
os.waitpid(attacker, 0)
share.destroy()
left = [l.split()[4] for l in open("/proc/self/mountinfo") if area in l]
print(json.dumps({"outcomes": outcomes, "escaped": sorted(set(escaped)), "left": left,
                  "canary": os.listdir(canary), "volume": os.listdir(volume),
                  "fds": len(os.listdir("/proc/self/fd")),
                  "state": os.listdir(os.path.join(area, "state"))}))
"""


def test_a_guest_rewriting_the_structure_gets_nothing_outside_it(tmp_path) -> None:
    got = in_pod_namespace(_ATTACK, str(tmp_path), timeout=300)
    assert got["escaped"] == [], got
    assert got["canary"] == [] and got["volume"] == [] and got["left"] == [], got
    assert got["state"] == [], got
    assert got["fds"] < 10, got  # nothing leaked per round
    # the race was run: the attacker won some rounds (the shim refused: an error, no
    # crash) and lost others
    refused = sum(n for o, n in got["outcomes"].items() if o != "shared")
    assert refused > 0, got
    # each refusal an OSError with its errno (the script dies on anything else)
    assert all(o == "shared" or o.removeprefix("remove ").startswith("E")
               for o in got["outcomes"]), got
