"""The directory templates are kept in (template_path), as a whole: whether it may be
trusted, what is in it (`podvmctl templates`), what goes when. Each template is a few
files named by its key (shim/vm/template/template.py): `<key>.json` (what it was made of, its
digests), `<key>.vmstate` and `<key>.vmstate.ram` (the saved VM), `<key>.lock` (held
while it is made or removed) and `<key>.uses` (one byte appended per restore: its size
is the template's hits, its mtime the last use).

Bounded: at most `template_max_count` templates and `template_max_mib` MiB on disk
(holes not counted). Room for a new one is made before it is made, least recently used
first out, never one being made; where there is no room (nor on the disk), the pod boots
and no template is made."""
from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import stat
import time

from ...host import mounts

log = logging.getLogger("podvm.template")

FORMAT = 5
"""Bumped when what a template holds changes in a way its key does not show."""
FILES = (".json", ".vmstate", ".vmstate.ram", ".uses")
"""A template's files, its metadata first: gone, it no longer exists (template.exists)."""
DISK_RESERVE = 256 << 20  # bytes left free on the file system, whatever the caps say
REMOTE_FILE_SYSTEMS = ("nfs", "nfs4", "cifs", "smb3", "smbfs", "9p", "virtiofs", "fuse",
                       "ceph", "glusterfs", "afs", "lustre", "gfs2", "ocfs2")


def refusal(directory: str) -> str:
    """Why templates may not be kept in `directory` (untrusted_store's), logged in the one
    line that also says pods boot; "" when they may."""
    why = untrusted_store(directory)
    if why:
        log.warning("templates off: %s (pods boot instead)", why)
    return why


def untrusted_store(directory: str) -> str:
    """Why templates may not be kept in `directory`, "" when they may: whoever can
    replace a template controls the guest of every later pod of its shape. It must be a
    directory (made here, 0700, when missing) that is no symlink, owned by root, mode
    0700, on a local file system."""
    try:
        if not os.path.lexists(directory):
            os.makedirs(os.path.dirname(directory), mode=0o755, exist_ok=True)
            os.mkdir(directory, 0o700)
        st = os.lstat(directory)
    except OSError as exc:
        return f"cannot make {directory}: {exc.strerror}"
    fstype = mounts.fstype_of(directory)
    if stat.S_ISLNK(st.st_mode):
        return f"{directory} is a symlink"
    if not stat.S_ISDIR(st.st_mode):
        return f"{directory} is not a directory"
    if st.st_uid != 0:
        return f"{directory} is owned by uid {st.st_uid}, not root"
    if stat.S_IMODE(st.st_mode) != 0o700:
        return f"{directory} has mode {stat.S_IMODE(st.st_mode):04o}, not 0700"
    if fstype in REMOTE_FILE_SYSTEMS or fstype.startswith("fuse."):
        return f"{directory} is on a {fstype} file system, not a local one"
    return ""


def listing(directory: str) -> list[dict]:
    """Every template in `directory`, least recently used first: key, shape (QEMU's
    -smp and -m), bytes on disk, made, made_by, last use, hits."""
    found = []
    for key in _keys(directory):
        path = os.path.join(directory, key)
        try:
            with open(f"{path}.json") as f:
                meta = json.load(f)
        except (OSError, ValueError):
            meta = {}
        command = meta.get("command") or []
        shape = {flag: command[i + 1] for i, flag in enumerate(command[:-1])
                 if flag in ("-smp", "-m")}
        uses = _stat(f"{path}.uses")
        found.append({"key": key, "shape": shape, "bytes": size(directory, key),
                      "made": meta.get("made"), "made_by": meta.get("made_by", ""),
                      "last_use": uses.st_mtime if uses else meta.get("made"),
                      "hits": uses.st_size if uses else 0})
    return sorted(found, key=lambda t: t["last_use"] or 0)


def size(directory: str, key: str) -> int:
    """Bytes the template takes on disk (its memory's holes not counted)."""
    total = 0
    for suffix in (".vmstate", ".vmstate.ram", ".json"):
        st = _stat(os.path.join(directory, key + suffix))
        total += st.st_blocks * 512 if st else 0
    return total


def remove(directory: str, key: str) -> bool:
    """The template's files gone, unless it is being made (False then). A pod loading
    it meanwhile reads on: its files are open."""
    try:
        fd = lock(directory, key)
    except OSError:
        return False
    if fd < 0:
        return False
    try:
        delete(directory, key, lock=True)
    finally:
        os.close(fd)
    return True


def lock(directory: str, key: str) -> int:
    """The descriptor that holds the right to make or remove the template (the flock
    goes with it), -1 while someone else holds it. Whoever takes it finds no maker of
    the template at work: what a maker killed mid-way left (a shim SIGKILLed, a node's
    power lost) goes now, before a new maker writes beside it."""
    fd = os.open(os.path.join(directory, f"{key}.lock"),
                 os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return -1
    for name in os.listdir(directory):
        made = MAKING_FILE.fullmatch(name)
        if made and made.group(1) == key:
            _unlink(os.path.join(directory, name))
    return fd


def delete(directory: str, key: str, lock: bool = False) -> None:
    """The template's files unlinked (and its lock file: `lock`), what is gone already
    left so. A pod reading it meanwhile reads on: its files are open."""
    for suffix in FILES + ((".lock",) if lock else ()):
        _unlink(os.path.join(directory, key + suffix))


def make_room(directory: str, disk_need: int, max_count: int, max_bytes: int) -> bool:
    """Room for one more template: the least recently used go until there are fewer than
    `max_count` and less than `max_bytes` is taken, and the disk must have `disk_need`
    bytes free (the template's VM writes its memory through a shared mapping: a full
    disk there would kill it); False, with nothing more removed, when there is not."""
    if max_count < 1 or max_bytes < 1:
        return False
    if not trim(directory, max_count - 1, max_bytes - 1):
        return False
    disk = os.statvfs(directory)
    return disk.f_bavail * disk.f_frsize >= disk_need + DISK_RESERVE


def trim(directory: str, max_count: int, max_bytes: int, keep: str = "") -> bool:
    """The least recently used removed (never `keep`, nor one being made) until at most
    `max_count` templates take at most `max_bytes`; whether that was reached."""
    present = listing(directory)

    def over() -> bool:
        return len(present) > max_count or sum(t["bytes"] for t in present) > max_bytes

    for oldest in [t for t in present if t["key"] != keep]:
        if not over():
            break
        if remove(directory, oldest["key"]):
            present.remove(oldest)
            log.info("template %s removed: the least recently used (%d hits)",
                     oldest["key"], oldest["hits"])
    return not over()


def record_use(directory: str, key: str) -> None:
    """One hit: a byte appended (atomic, whoever else restores it now)."""
    try:
        fd = os.open(os.path.join(directory, f"{key}.uses"),
                     os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
    except OSError as exc:
        log.warning("template %s: its use not recorded: %s", key, exc.strerror)
        return
    try:
        os.write(fd, b".")
    finally:
        os.close(fd)


def prune(directory: str) -> list[str]:
    """Remove the templates whose files (QEMU, kernel, initrd, image) changed or are
    gone, and states whose metadata was never written; the keys removed."""
    removed = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return removed
    for name in names:
        path = os.path.join(directory, name)
        if name.endswith(".json"):
            key = name[:-len(".json")]
            try:
                with open(path) as f:
                    meta = json.load(f)
                inputs = meta["inputs"]
                stale = meta.get("format") != FORMAT or any(
                    identity(file_id[0]) != file_id for file_id in inputs.values())
            except (OSError, ValueError, KeyError, TypeError, IndexError):
                stale = True
            if stale:
                delete(directory, key, lock=True)
                removed.append(key)
        elif name.endswith((".vmstate", ".vmstate.ram")) and not os.path.exists(
                path[:path.index(".vmstate")] + ".json"):
            _unlink(path)  # its metadata was never written: an interrupted save
        elif making := MAKING_FILE.fullmatch(name):
            _unlink_unless_made(directory, making.group(1))
    if removed:
        log.info("templates of changed files removed: %s", ", ".join(removed))
    return removed


MAKING_FILE = re.compile(r"([0-9a-f]+)\.(?:vmstate\.\d+\.tmp(?:\.ram)?|json\.tmp)")
"""A template's files while its maker writes them (shim/vm/template/template.py: the state,
`<key>.vmstate.<pid>.tmp`, the memory beside it, then `<key>.json.tmp`)."""


def _unlink_unless_made(directory: str, key: str) -> None:
    """The files a maker of `key` left when it was killed (`shim delete` cannot know the
    store), unless someone is making that template now: taking its lock removes them."""
    fd = lock(directory, key)
    if fd >= 0:
        os.close(fd)


def identity(path: str) -> list:
    """What tells a file from the next version of it: path, size, mtime, inode."""
    try:
        st = os.stat(path)
    except OSError:
        return [path, -1, -1, -1]
    return [path, st.st_size, st.st_mtime_ns, st.st_ino]


def age(seconds_since_epoch: float | None) -> str:
    if not seconds_since_epoch:
        return "-"
    ago = max(0, time.time() - seconds_since_epoch)
    for unit, length in (("d", 86400), ("h", 3600), ("m", 60)):
        if ago >= length:
            return f"{ago // length:.0f}{unit} ago"
    return f"{ago:.0f}s ago"


def _keys(directory: str) -> list[str]:
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return sorted(n[:-len(".json")] for n in names if n.endswith(".json"))


def _stat(path: str) -> os.stat_result | None:
    try:
        return os.stat(path)
    except FileNotFoundError:
        return None


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
