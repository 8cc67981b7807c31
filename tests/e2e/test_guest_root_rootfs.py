"""Guest root against the container's image on the host, through containerd's CRI: with
its writable layer on the pod's scratch disk, a container's rootfs in the share is only
the lower layer of its overlay in the guest, yet it is containerd's snapshot on the host
disk, where no limit of the pod's holds what is written. A privileged container escapes
to root in the guest (as in test_hostile_guest.py: a core-dump helper of its choosing,
run by the guest kernel) and writes its own image through the share: a new file, a
setuid copy of busybox, a setuid bit on busybox, a line in /etc/passwd, a directory, an
applet removed, a time changed; and the pod holder's (pause's) image beside it, which
no process in the guest uses. Every one is refused, and not one entry of containerd's
snapshots on the host changes; the container's own root stays the guest's to write."""
from __future__ import annotations

import os
import pathlib

from testbed.cri import write_config
from testbed.pods import pod_config, podvm_leftovers

from .test_crictl import wait_for
from .test_hostile_guest import _wait_file, escaping_container
from .test_podvm_pods import configs, crictl, remove_pod  # noqa: F401

# Run by the guest kernel as root in the guest's first namespaces (the core-dump helper),
# as /proc/<pid>/root/tools/escape.sh; the applets from the container's busybox.
ESCAPE = r"""
tools=${0%/escape.sh}
root=${tools%/tools}
bb=$root/bin/busybox
# the container's image in the share: the lower layer of the overlay that is its root
image=$($bb sed -n 's|.* / / .* - overlay .*lowerdir=\([^,]*\)/\.,.*|\1|p' \
        "${root%/root}/mountinfo" | $bb head -n 1)
case "$image" in
    /run/podvm/shared/*/rootfs) ;;
    *) echo "no layer in the guest over the share: '$image'" > "$root/tally"; exit 1 ;;
esac
[ -e "$root/attacker-marker" ] && [ -x "$image/bin/busybox" ] || exit 1
# the pod holder's (pause's) image beside it: the agent stands in for its process
holder=
for other in /run/podvm/shared/*/rootfs; do [ "$other" = "$image" ] || holder=$other; done
[ -n "$holder" ] || { echo "no holder's rootfs in the share" > "$root/tally"; exit 1; }
let=0 refused=0
try() {
    if "$@" 2>/dev/null; then let=$((let+1)); echo "$*" >> "$root/let"
    else refused=$((refused+1)); fi
}
try $bb sh -c "echo guest-root-was-here > $image/planted"
try $bb cp "$bb" "$image/bin/planted-suid"
try $bb chmod 4755 "$image/bin/busybox"
try $bb sh -c "echo 'evil::0:0::/:/bin/sh' >> $image/etc/passwd"
try $bb mkdir "$image/planted-dir"
try $bb rm "$image/bin/ls"
try $bb touch "$image/etc"
try $bb sh -c "echo guest-root-was-here > $holder/planted"
try $bb mkdir "$holder/planted-dir"
echo "let=$let refused=$refused done=1" > "$root/tally"
"""


def _snapshots(ctd) -> dict[str, tuple[int, int, int, int]]:
    """Every entry of containerd's overlay snapshots on the host: mode, size, owner and
    modification time."""
    root = pathlib.Path(ctd.root) / "io.containerd.snapshotter.v1.overlayfs" / "snapshots"
    seen = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            seen[os.path.relpath(path, root)] = (st.st_mode, st.st_size, st.st_uid,
                                                 st.st_mtime_ns)
    return seen


def test_guest_root_cannot_write_the_containers_image_on_the_host(
        ctd, crictl, configs, tmp_path: pathlib.Path) -> None:  # noqa: F811
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "escape.sh").write_text(ESCAPE)
    (tools / "escape.sh").chmod(0o755)
    pod_file = write_config(configs, "pod-image-writer.json", pod_config(
        ctd, configs, "image-writer", linux={"cgroup_parent": ctd.cgroup_parent,
                                             "security_context": {"privileged": True}}))
    pod_id = crictl.runp(pod_file, runtime="podvm")
    try:
        attacker = escaping_container("image-writer", tools,
                                      "while [ ! -e /go ]; do sleep 0.2; done; ")
        cid = crictl.create(pod_id, write_config(configs, "image-writer.json", attacker),
                            pod_file)
        crictl.start(cid)
        wait_for("the attacker to be set up", lambda: crictl.exec(
            cid, "sh", "-c", "test -e /attacker-marker && grep -q escape "
                             "/proc/sys/kernel/core_pattern").exit_code == 0)
        before = _snapshots(ctd)
        crictl.exec(cid, "touch", "/go")
        tally = _wait_file(crictl, cid, "/tally", 120)
        after = _snapshots(ctd)
        assert "done=1" in tally, tally
        counts = dict(part.split("=") for part in tally.split())
        changed = sorted(p for p in before.keys() | after.keys()
                         if before.get(p) != after.get(p))
        assert changed == [], (f"guest root changed containerd's snapshots on the host: "
                               f"{changed}; it says {tally}")
        assert counts["let"] == "0", (tally, crictl.exec(cid, "cat", "/let").stdout)
        assert counts["refused"] == "9", tally
        # the container's own root is the guest's to write, as under runc
        wrote = crictl.exec(cid, "sh", "-c", "echo mine > /mine && cat /mine")
        assert (wrote.exit_code, wrote.stdout) == (0, "mine\n"), wrote
    finally:
        remove_pod(crictl, pod_id)
    assert podvm_leftovers(ctd, pod_id) == []
