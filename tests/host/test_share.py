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
from testbed.prereqs import require_root

ROOT = pathlib.Path(__file__).parents[2]
SHARED_AT_LEAST = 3
"""Of the attack's 150 rounds, how many the shim must win: ~25 on an idle machine, 12 with
four runs at once on two cores; a shim that refuses every round wins none."""


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
# Each share that succeeds is looked at with the attacker stopped: a shim that refused
# every round, or said "shared" without having shared, would pass a test of refusals.
_ATTACK = r"""
import errno, re, signal, time
from shim.host import beneath
from shim.host.share import Share
area = sys.argv[1]
canary, volume, hosts, rootfs = (os.path.join(area, n)
                                 for n in ("canary", "volume", "hosts", "rootfs"))
for d in (canary, volume, rootfs):
    os.makedirs(d)
open(hosts, "w").write("hosts\n")
open(os.path.join(rootfs, "marker"), "w").write("rootfs\n")
open(os.path.join(volume, "marker"), "w").write("volume\n")
share = Share(os.path.join(area, "state"))
share.create()
tree = share.tree
# what each shared source must read and its top mount's flags, in `shared/` and `export/`
EXPECTED = {"rootfs": ("marker", "rootfs\n", "rw"), "0-vol": ("marker", "volume\n", "rw"),
            "1-hosts": ("", "hosts\n", "ro")}
PLACE = re.compile(r"c1(\.\d+)?/(rootfs|mounts(\.\d+)?/(0-vol|1-hosts))")
tops = {t: os.open(t, os.O_PATH | os.O_DIRECTORY) for t in (share.tree, share.export)}

def mount_table():
    return {l.split()[0]: (l.split()[4], l.split()[5]) for l in open("/proc/self/mountinfo")}

def wrong_in(new):
    # what is wrong with the mounts one share made ({mount id: (point, flags)}), in words:
    # each source once in `shared/` and once in `export/`, at its place (the attacker may
    # have renamed the directories above it since), with its content and flags
    wrong, found = [], []
    for point, flags in new.values():
        top = next((t for t in tops if point.startswith(t + "/")), None)
        place = PLACE.fullmatch(point[len(top) + 1:]) if top else None
        if place is None:
            wrong.append(f"a mount at {point}")
            continue
        name = place.group(4) or "rootfs"
        inside, content, mode = EXPECTED[name]
        try:
            fd = beneath.openat2(tops[top], os.path.join(place.group(0), inside).rstrip("/"),
                                 os.O_RDONLY, beneath.STRICT)
            got = os.read(fd, 100).decode()
            os.close(fd)
        except OSError as exc:
            got = exc.strerror
        options = set(flags.split(","))
        if got != content or mode not in options or \
                not {"nosuid", "nodev", "noexec"} <= options:
            wrong.append(f"{point} ({flags}) reads {got!r}")
        found.append((top, name))
    if sorted(found) != sorted((t, n) for t in tops for n in EXPECTED):
        wrong.append(f"mounts made: {sorted(found)}")
    return wrong
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
outcomes, escaped, bad_shares = {}, [], []
for i in range(150):
    mounted = mount_table()
    try:
        share.add("c1", rootfs, True, [(volume, "0-vol", False, False),
                                        (hosts, "1-hosts", True, False)])
        outcome = "shared"
    except OSError as exc:
        outcome = errno.errorcode.get(exc.errno, str(exc.errno))
    outcomes[outcome] = outcomes.get(outcome, 0) + 1
    if outcome == "shared":
        os.kill(attacker, signal.SIGSTOP)
        os.waitpid(attacker, os.WUNTRACED)
        new = {n: m for n, m in mount_table().items() if n not in mounted}
        bad_shares += wrong_in(new)
        os.kill(attacker, signal.SIGCONT)
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
for fd in tops.values():
    os.close(fd)
print(json.dumps({"outcomes": outcomes, "escaped": sorted(set(escaped)), "left": left,
                  "bad_shares": bad_shares,
                  "canary": os.listdir(canary), "volume": os.listdir(volume),
                  "fds": len(os.listdir("/proc/self/fd")),
                  "state": os.listdir(os.path.join(area, "state"))}))
"""


def test_a_guest_rewriting_the_structure_gets_nothing_outside_it(tmp_path) -> None:
    got = in_pod_namespace(_ATTACK, str(tmp_path), timeout=300)
    assert got["escaped"] == [], got
    assert got["canary"] == [] and got["volume"] == ["marker"] and got["left"] == [], got
    assert got["state"] == [], got
    assert got["fds"] < 10, got  # nothing leaked per round
    # the race was run: the attacker won some rounds (the shim refused: an error, no
    # crash) and lost others, in which the container was shared as asked: each source
    # where the guest looks for it, read-write or read-only as asked, never host-executable
    assert got["bad_shares"] == [], got
    assert got["outcomes"].get("shared", 0) >= SHARED_AT_LEAST, got
    refused = sum(n for o, n in got["outcomes"].items() if o != "shared")
    assert refused > 0, got
    # each refusal an OSError with its errno (the script dies on anything else)
    assert all(o == "shared" or o.removeprefix("remove ").startswith("E")
               for o in got["outcomes"]), got
