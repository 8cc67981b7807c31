"""A hostile guest against the shared directory, through containerd's CRI: a privileged
container escapes to root in the guest (its kernel runs a core-dump helper of the
container's choosing as root in the guest's first namespaces) and from there attacks the
pod's share for as long as the test lasts, with the moves that worked against Kata
(CVE-2020-2026): every entry of the structure the shim walks moved away, removed and
swapped for a symlink to a host directory, new names planted, the state directory's
tmpfs filled; writes through each container's files in the share: its rootfs, its pod
files (/etc/hosts, /etc/hostname, /etc/resolv.conf), a read-write and a read-only volume;
and its scratch disk written raw, inside and past its end. Meanwhile the test creates,
starts and removes containers with volumes and host files, each kept until the attacker
says it has attacked it.

Nothing the guest does may reach the host but what the pod's containers could write
under runc: no write to the structure is let through (QEMU exports it read-only); of the
containers' files only those their OCI specs bind read-write take the guest's writes (the
read-write volume; the pod files where containerd binds them read-write, as for runc),
and no container's rootfs (each is shared read-only: a container's writable layer is in
the guest, and the pod holder's process is the agent's, which writes none); nothing appears in the host directory the symlinks name,
nothing is mounted outside the pod's state directory, every container still works, and
nothing is left when the pod goes."""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
import re
import time

from shim.host import paths
from shim.vm import scratchdisk
from testbed.containerd import CRI_NAMESPACE, shims_of
from testbed.cri import write_config
from testbed.pods import container_config, pod_config, pod_qemus, podvm_leftovers
from testbed.vmconfig import vm_config

from .test_crictl import wait_for
from .test_podvm_pods import configs, crictl, remove_pod, scratch_disk  # noqa: F401

DISK_MARK = b"guest-root-was-here"
POD_FILES = ("hosts", "hostname", "resolv.conf")
"""The names of the pod files CRI binds in each container (from its sandbox directory)."""
ATTEMPTS_PER_VICTIM = 20
"""At least this many attacks on each victim's entries while they existed: one round on
one victim tries ~35 (a write per file, four moves per entry of the structure); an
attacker that only attacks the share's root, or attacks a victim's directory after it
went, tries none."""
ATTACK_SECONDS = 600
"""At most: the attack goes on until the test has done its rounds and says stop."""
VICTIM_ROUNDS = 2
"""Containers made, used and removed under attack, one after the other."""

# Run by the guest kernel as root in the guest's first namespaces (the core-dump helper)
# as /proc/<pid>/root/tools/escape.sh: its arguments in args beside it (core_pattern holds
# 127 characters), the applets from the container's busybox (the guest's PATH has others).
ESCAPE = r"""
tools=${0%/escape.sh}
root=${tools%/tools}
bb=$root/bin/busybox
read canary seconds disk_mib < "$tools/args"
share=/run/podvm/shared
# the container's own directory in the share: its root's (over a layer in the guest,
# /run/podvm/rootfs/<id>; else the share's <id>/rootfs itself)
at=$($bb readlink "$root")
case "$at" in
    $share/*/rootfs) me=${at%/rootfs}/ ;;
    *) me=$share/${at##*/}/ ;;
esac
[ -d "$me" ] && [ -e "$root/attacker-marker" ] || exit 1
echo "root uid=$($bb id -u) sees $($bb ls $share | $bb wc -l) containers" > "$root/escaped"
let=0 refused=0 wrote=0
try() {
    if "$@" 2>/dev/null; then let=$((let+1)); echo "${*#$bb }" >> "$root/let"
    else refused=$((refused+1)); fi
}
# a write through a container's files: what is let through is on the host
write() {
    if $bb dd if="$tools/mark" of="$1" oflag=append conv=notrunc 2>/dev/null; then
        wrote=$((wrote+1)); echo "${1#$share/}" >> "$root/wrote"
    else refused=$((refused+1)); fi
}
# the pod's scratch disk, raw: its last MiB is the guest's to write (the test finds the
# mark in QEMU's own file, never in the blank every pod starts from); past its end, not
disk=
for b in /sys/block/*; do
    [ "$($bb cat "$b/serial" 2>/dev/null)" = podvm-scratch ] && disk=/dev/${b##*/}
done
[ -b "$disk" ] || exit 2
echo "guest-root-was-here" | $bb dd of="$disk" bs=1M seek=$((disk_mib - 1)) conv=notrunc,fsync \
    2>/dev/null && echo "$disk" > "$root/disk"
end=$(( $($bb date +%s) + seconds ))
n=0
while [ "$($bb date +%s)" -lt "$end" ] && [ ! -e "$root/stop" ]; do
    n=$((n+1))
    for d in $share/*/; do
        [ "$d" = "$me" ] || [ -e "$root/stop" ] && continue
        d=${d%/}
        # logged when the container's files were there to attack: its id, the round,
        # what was tried and refused, the files found
        [ -d "$d/rootfs/bin" ] && found=1 || found=0
        before=$((let+refused+wrote)) refused_before=$refused mounts=
        write "$d/rootfs/planted-$n"
        write "$d/rootfs/etc/passwd"
        for m in "$d"/mounts/*; do
            if [ -d "$m" ]; then write "$m/planted-$n"; else write "$m"; fi
            mounts="$mounts,${m##*/}"
        done
        for p in "$d" "$d/rootfs" "$d/mounts" "$d"/mounts/*; do
            try $bb mv "$p" "$p.$n"
            try $bb rmdir "$p"
            try $bb unlink "$p"
            try $bb ln -sT "$canary" "$p"
        done
        try $bb mkdir "$d/mounts"
        try $bb ln -sT "$canary" "$d/mounts/planted-$n"
        [ $found = 1 ] && echo "${d##*/} $n $((let+refused+wrote-before))" \
            "$((refused-refused_before)) ${mounts#,}" >> "$root/attacked"
    done
    try $bb ln -sT "$canary" "$share/next-$n"
    try $bb mkdir "$share/next-$n"
    try $bb dd if=/dev/zero of="$share/fill" bs=64k count=16
    try $bb dd if=/dev/zero of="$disk" bs=1M seek="$disk_mib" count=1
    echo "let=$let refused=$refused wrote=$wrote rounds=$n" > "$root/tally"
done
echo "let=$let refused=$refused wrote=$wrote rounds=$n done=1" > "$root/tally"
"""


def test_a_guest_root_attacking_the_share_gets_nothing(ctd, crictl, configs,
                                                       tmp_path: pathlib.Path) -> None:
    canary, tools = tmp_path / "canary", tmp_path / "tools"
    volume, ro_volume = tmp_path / "volume", tmp_path / "ro-volume"
    for d in (canary, tools, volume, ro_volume):
        d.mkdir()
    (ro_volume / "kept").write_text("kept\n")
    (tools / "escape.sh").write_text(ESCAPE)
    (tools / "escape.sh").chmod(0o755)
    (tools / "mark").write_bytes(DISK_MARK + b"\n")
    q = vm_config().qemu  # the pods' configuration (testbed/vmconfig.py)
    (tools / "args").write_text(f"{canary} {ATTACK_SECONDS} {q.scratch_disk_mib}\n")
    blank = scratchdisk.blank(q)
    blank_before = _digest(blank)
    pod_file = write_config(configs, "pod-hostile.json", pod_config(
        ctd, configs, "hostile", linux={"cgroup_parent": ctd.cgroup_parent,
                                        "security_context": {"namespace_options":
                                                             {"network": 0},
                                                             "privileged": True}}))
    pod_id = crictl.runp(pod_file, runtime="podvm")
    allowed: tuple[str, ...] = (paths.state_dir(CRI_NAMESPACE, pod_id), str(ctd.workdir))
    try:
        pod_files = _pod_files(ctd, pod_id)  # before any container could write them
        shims = [pid for pid, cmd in shims_of(ctd.address) if pod_id in cmd]
        before = {pid: set(_mount_points(pid)) for pid in ("self", *shims)}
        attacker = escaping_container("attacker", tools)
        attacker_id = crictl.create(pod_id, write_config(configs, "attacker.json", attacker),
                                    pod_file)
        crictl.start(attacker_id)
        escaped = _wait_file(crictl, attacker_id, "/escaped", 60)
        assert escaped.startswith("root uid=0 sees"), escaped  # root in the guest
        # its raw disk: the guest wrote its own unnamed file, not the blank (looked at
        # before any container goes: the disk is trimmed then, the mark in free space)
        assert _wait_file(crictl, attacker_id, "/disk", 60).startswith("/dev/vd")
        assert DISK_MARK in _last_mib_of_the_disk(pod_qemus(pod_id)[0], q.scratch_disk_mib)
        assert _digest(blank) == blank_before
        # the binds runc would let each container write (the attacker's own too: the
        # guest's root is every container of the pod)
        writable = {cid: _writable_binds(ctd, cid) for cid in (pod_id, attacker_id)}
        victims = [_a_container_with_volumes(ctd, crictl, configs, pod_id, pod_file,
                                             attacker_id, volume, ro_volume, n)
                   for n in range(1, VICTIM_ROUNDS + 1)]
        victim_ids = [cid for cid, _, _ in victims]
        writable.update((cid, binds) for cid, _, binds in victims)
        assert "done" not in crictl.exec(attacker_id, "cat", "/tally").stdout  # under attack
        crictl.exec(attacker_id, "touch", "/stop")
        tally = _wait_file(crictl, attacker_id, "/tally", 180, "done=1")
        counts = dict(part.split("=") for part in tally.split())
        # each victim's files attacked while they were there, each kind of them
        attacked = _attacks(crictl.exec(attacker_id, "cat", "/attacked").stdout)
        for cid in victim_ids:
            tried, _, names = attacked.get(cid, (0, 0, set()))
            assert tried >= ATTEMPTS_PER_VICTIM, (cid, attacked)
            kinds = {name.partition("-")[2] for name in names}
            assert {"data", "ro", *POD_FILES} <= kinds, (cid, names)
        assert int(counts["rounds"]) > 1, tally
        # not one write to the structure got through
        assert counts["let"] == "0", (tally, crictl.exec(attacker_id, "cat", "/let").stdout)
        # of the containers' files, the guest wrote what runc would let the containers
        # write and nothing else: on the host, and as the attacker says
        wrote = crictl.exec(attacker_id, "cat", "/wrote").stdout.split()
        rw_pod_files = {n for binds in writable.values() for b in binds
                        for n in POD_FILES if b.endswith(f"-{n}")}
        pod_files_now = _pod_files(ctd, pod_id)
        reached = {
            "pod files changed": [n for n in POD_FILES if pod_files_now[n] != pod_files[n]
                                  and (n not in rw_pod_files or pod_files_now[n].replace(
                                       DISK_MARK + b"\n", b"") != pod_files[n])],
            "rootfs files planted": sorted({p for _, planted, _ in victims for p in planted}),
            "read-only volume files": sorted(p.name for p in ro_volume.iterdir()
                                             if p.name != "kept"),
            "writes let through beyond runc's": sorted({
                ("pod holder " if w.startswith(pod_id) else "") +
                re.sub(r"\d+", "N", w.partition("/")[2]) for w in wrote
                if not _runc_could(w, writable)})}
        assert reached == {what: [] for what in reached}, tally
        assert any(re.search(r"/mounts/\d+-data/planted-\d+$", w) for w in wrote), wrote
        assert (ro_volume / "kept").read_text() == "kept\n"
        assert {p.name for p in volume.iterdir()} == {"round", *(
            w.rsplit("/", 1)[1] for w in wrote if re.search(r"/mounts/\d+-data/", w))}
        assert list(canary.iterdir()) == []
        assert _digest(blank) == blank_before
        assert shims and all(_mount_points(pid) for pid in shims), "the pod's shim died"
        for pid in ("self", *shims, *pod_qemus(pod_id)):
            assert [m for m in _mount_points(pid) if m.startswith(str(tmp_path))] == [], pid
        # the pod's namespace: nothing mounted but in the pod's own places; the host's
        # (where other programs mount too): nothing of podvm's at all
        for pid, points in before.items():
            new = set(_mount_points(pid)) - points
            if pid == "self":
                new = {m for m in new if pod_id in m or m.startswith(paths.STATE_ROOT)}
            ok = () if pid == "self" else allowed
            assert [m for m in new if not m.startswith(ok)] == [], (pid, new)
        for pid in shims:  # the victims' mounts go with them (containerd deletes a task
            # once it has seen its exit: after `crictl rm` has returned)
            wait_for("the victims' mounts to go", lambda: not [
                m for m in _mount_points(pid) if any(v in m for v in victim_ids)])
    finally:
        remove_pod(crictl, pod_id)
    assert podvm_leftovers(ctd, pod_id) == []


def escaping_container(name: str, tools: pathlib.Path, before_crash: str = "") -> dict:
    """A privileged container that makes the guest kernel's core-dump helper
    `tools`/escape.sh (run by the guest's root, outside every container) and crashes,
    after `before_crash` (shell) has run."""
    return dict(container_config(name, (
        "touch /attacker-marker; "
        "echo 1 > /proc/sys/kernel/core_pipe_limit; "
        "echo '|/proc/%P/root/bin/busybox sh /proc/%P/root/tools/escape.sh' "
        "> /proc/sys/kernel/core_pattern; "
        f"ulimit -c unlimited; {before_crash}sh -c 'kill -SEGV $$'; exec sleep 1000")),
        linux={"security_context": {"privileged": True}},
        mounts=[{"container_path": "/tools", "host_path": str(tools), "readonly": True}])


def _a_container_with_volumes(ctd, crictl, configs, pod_id, pod_file, attacker_id, volume,
                              ro_volume, n) -> tuple[str, list[str], set[str]]:
    """Created, started, used, removed once the attacker has attacked it: the attack
    changes none of it. Its id, what the attacker planted in its rootfs on the host
    (containerd's snapshot, as the shim mounted it in the pod's mount namespace), and
    the binds runc would let it write."""
    config = dict(container_config(f"victim-{n}", f"echo {n} > /data/round; exec sleep 1000"),
                  mounts=[{"container_path": "/data", "host_path": str(volume)},
                          {"container_path": "/ro", "host_path": str(ro_volume),
                           "readonly": True}])
    cid = crictl.create(pod_id, write_config(configs, f"victim-{n}.json", config), pod_file)
    crictl.start(cid)
    read = crictl.exec(cid, "sh", "-c", "sleep 0.2; cat /ro/kept /data/round /etc/hostname")
    assert read.exit_code == 0 and read.stdout.startswith(f"kept\n{n}\n"), read
    wait_for(f"the attacker to attack victim {n}", lambda: len(_attacks(crictl.exec(
        attacker_id, "cat", "/attacked").stdout).get(cid, (0, 0, ()))[2]) > 0, timeout=180)
    binds = _writable_binds(ctd, cid)
    shim = next(pid for pid, cmd in shims_of(ctd.address) if pod_id in cmd)
    bundle = next(ctd.state.glob(f"io.containerd.runtime.v2.task/*/{cid}"))
    rootfs = pathlib.Path(f"/proc/{shim}/root{bundle}/rootfs")
    planted = sorted(p.name for p in rootfs.iterdir() if p.name.startswith("planted-"))
    if DISK_MARK in (rootfs / "etc" / "passwd").read_bytes():
        planted.append("etc/passwd")
    crictl.run("stop", "-t", "0", cid)
    crictl.run("rm", cid)
    assert (volume / "round").read_text() == f"{n}\n"
    return cid, planted, binds


def _writable_binds(ctd, cid: str) -> set[str]:
    """The container's binds its OCI spec has read-write (what runc would let it write),
    by their names in the share (shim/vm/guestspec.py: `<index>-<basename>`)."""
    bundle = next(ctd.state.glob(f"io.containerd.runtime.v2.task/*/{cid}"))
    spec = json.loads((bundle / "config.json").read_text())
    return {f"{i}-{os.path.basename(m['destination'].rstrip('/'))}"
            for i, m in enumerate(spec.get("mounts") or [])
            if (m.get("type") == "bind" or "bind" in (m.get("options") or []) or
                "rbind" in (m.get("options") or [])) and "ro" not in (m.get("options") or [])}


def _runc_could(write: str, writable: dict[str, set[str]]) -> bool:
    """Whether a container could make `write` (the attacker's, relative to the share)
    under runc: into a bind its spec has read-write. No rootfs: each one's writable
    layer is in the guest (the pod holder has none: no process of its own there)."""
    cid, _, rest = write.partition("/")
    bind = re.fullmatch(r"mounts/([^/]+)(/planted-\d+)?", rest)
    return bind is not None and bind.group(1) in writable.get(cid, set())


def _attacks(log: str) -> dict[str, tuple[int, int, set[str]]]:
    """The attacker's /attacked, by container: attacks tried, refused, the files seen."""
    found: dict[str, tuple[int, int, set[str]]] = {}
    for line in log.splitlines():
        cid, _, tried, refused, *names = line.split()
        t, r, seen = found.get(cid, (0, 0, set()))
        found[cid] = (t + int(tried), r + int(refused),
                      seen | set(names[0].split(",") if names else ()))
    return found


def _pod_files(ctd, pod_id: str) -> dict[str, bytes]:
    """The pod's /etc files on the host (CRI's, in its sandbox directory)."""
    directory = ctd.root / "io.containerd.grpc.v1.cri" / "sandboxes" / pod_id
    return {name: (directory / name).read_bytes() for name in POD_FILES}


def _digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _last_mib_of_the_disk(qemu: int, size_mib: int) -> bytes:
    """The start of the last MiB of the pod's scratch disk, read through QEMU's
    descriptor of its unnamed file."""
    with open(scratch_disk(qemu, size_mib), "rb") as f:
        f.seek((size_mib - 1) << 20)
        return f.read(4096)


def _wait_file(crictl, cid: str, path: str, timeout: float, last: str = "") -> str:
    """What `path` in the container says once it says `last` (anything, when "")."""
    deadline = time.monotonic() + timeout
    while True:
        got = crictl.exec(cid, "cat", path)
        if got.exit_code == 0 and last in got.stdout and got.stdout.strip():
            return got.stdout.strip()
        assert time.monotonic() < deadline, f"no {path} in the attacker's root: {got}"
        time.sleep(1)


def _mount_points(pid) -> list[str]:
    try:
        with open(f"/proc/{pid}/mountinfo") as f:
            return [line.split()[4] for line in f]
    except OSError:
        return []
