"""A container's rootfs in the pod's share (shim/host/share.py) when its writable layer
is in the guest: the guest only reads its image there, so the host makes it read-only all
the way down, submounts included, and a guest that writes the share's rootfs (as root,
with every file mode) changes nothing of containerd's snapshot. Where the guest writes
the rootfs itself (no scratch disk), it stays writable."""
from __future__ import annotations

import pytest

from shim.host import mounts

from .test_share import in_pod_namespace

_WRITE_ROOTFS = r"""
from shim.host.share import Share
area, readonly = sys.argv[1], sys.argv[2] == "1"
rootfs = os.path.join(area, "rootfs")
share = Share(os.path.join(area, "state"))
share.create()
share.add("c1", rootfs, True, [], rootfs_readonly=readonly)
root = os.path.join(share.export, "c1", "rootfs")
def attempt(what, *args):
    try:
        what(*args)
        return "ok"
    except OSError as exc:
        return exc.strerror
def write(path, mode=0o644):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, mode)
    try:
        os.write(fd, b"guest was here\n")
    finally:
        os.close(fd)
seen = {
    "new file": attempt(write, root + "/planted"),
    "setuid file": attempt(write, root + "/bin/planted-suid", 0o4755),
    "existing file": attempt(write, root + "/etc/passwd"),
    "chmod setuid": attempt(os.chmod, root + "/bin/sh", 0o4755),
    "mkdir": attempt(os.mkdir, root + "/new-dir"),
    "unlink": attempt(os.unlink, root + "/etc/passwd"),
    "submount file": attempt(write, root + "/var/cache/planted"),
}
share.remove("c1")
share.destroy()
print(json.dumps(seen))
"""


def _rootfs(tmp_path):
    rootfs = tmp_path / "rootfs"
    for d in ("bin", "etc", "var/cache"):
        (rootfs / d).mkdir(parents=True)
    (rootfs / "etc" / "passwd").write_text("root:x:0:0::/root:/bin/sh\n")
    (rootfs / "bin" / "sh").write_text("#!\n")
    (rootfs / "bin" / "sh").chmod(0o755)
    return rootfs


def _listing(root) -> dict[str, tuple[int, int, int]]:
    return {str(p.relative_to(root)): (p.lstat().st_mode, p.lstat().st_size,
                                       p.lstat().st_mtime_ns)
            for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize("readonly", [True, False])
def test_a_rootfs_over_a_layer_in_the_guest_is_read_only_to_it(tmp_path, readonly) -> None:
    rootfs = _rootfs(tmp_path)
    cache = rootfs / "var" / "cache"  # a host mount below the rootfs: read-only too
    mounts.mount(mounts.Mount("tmpfs", "tmpfs", ("size=1m",)), str(cache))
    try:
        before = _listing(rootfs)
        seen = in_pod_namespace(_WRITE_ROOTFS, str(tmp_path), "1" if readonly else "0")
        after = _listing(rootfs)
    finally:
        mounts.unmount(str(cache))
    if readonly:
        assert seen == dict.fromkeys(seen, "Read-only file system")
        assert after == before
    else:  # the guest's runc writes the rootfs itself: as under runc
        assert seen == dict.fromkeys(seen, "ok")
        assert (rootfs / "planted").exists()
