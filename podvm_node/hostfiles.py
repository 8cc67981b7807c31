"""Files podvm-node puts on the host, and the record of them (HOST/opt/podvm/.installed,
JSON) from which uninstall takes out exactly what install added: the directories it
made, the files it wrote, the bytes it put into containerd's config.toml. The bundle
itself is a tree of its own, /opt/podvm/<name>, with /opt/podvm/current linking to the
newest (podvm_core/trees.py)."""
from __future__ import annotations

import hashlib
import json
import os
import stat
from dataclasses import asdict, dataclass, field

from podvm_core import treegc, trees

from . import elfpatch
from .containerd_dropin import Edit

PREFIX = "/opt/podvm"
RECORD = PREFIX + "/.installed"
CURRENT = PREFIX + "/" + trees.CURRENT
RELOCATED = ("bin", "libexec", "python/bin")
"""Where the bundle's executables are: their loader and #! paths name the tree."""


@dataclass
class Record:
    directories: list[str] = field(default_factory=list)
    """Made by install (host paths), parents first."""
    files: list[str] = field(default_factory=list)
    """Written by install (host paths), removed by uninstall."""
    config_edit: dict | None = None
    """containerd_dropin.Edit as a dict."""

    @property
    def edit(self) -> Edit | None:
        return Edit(**self.config_edit) if self.config_edit else None


def load(host: str) -> Record | None:
    try:
        with open(host + RECORD) as f:
            return Record(**json.load(f))
    except FileNotFoundError:
        return None


def save(record: Record, path: str) -> None:
    with open(path, "w") as f:
        json.dump(asdict(record), f, indent=2)
        f.write("\n")


def make_dirs(host: str, path: str, record: Record) -> None:
    """`path` and its missing parents, each recorded."""
    missing = []
    at = path
    while not os.path.isdir(host + at):
        missing.append(at)
        at = os.path.dirname(at)
    for directory in reversed(missing):
        os.mkdir(host + directory, 0o755)
        if directory not in record.directories:
            record.directories.append(directory)


def copy_tree(source: str, target: str) -> None:
    """`source` to a new `target`, holes kept (the root image is mostly one)."""
    os.mkdir(target, 0o755)
    for dirpath, dirnames, filenames in os.walk(source):
        rel = os.path.relpath(dirpath, source)
        into = os.path.normpath(os.path.join(target, rel))
        for name in dirnames:
            mode = os.stat(os.path.join(dirpath, name)).st_mode & 0o7777
            os.mkdir(os.path.join(into, name), mode)
        for name in filenames:
            src = os.path.join(dirpath, name)
            mode = os.lstat(src).st_mode
            if stat.S_ISLNK(mode):
                os.symlink(os.readlink(src), os.path.join(into, name))
            elif stat.S_ISREG(mode):
                copy_sparse(src, os.path.join(into, name))
            else:
                raise OSError(f"{src}: not a file, directory or link: not a podvm bundle")


def copy_sparse(src: str, dst: str) -> None:
    with open(src, "rb") as fin:
        st = os.fstat(fin.fileno())
        fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, st.st_mode & 0o7777)
        try:
            offset = 0
            while offset < st.st_size:
                try:
                    data = os.lseek(fin.fileno(), offset, os.SEEK_DATA)
                except OSError:  # ENXIO: only a hole is left
                    break
                hole = os.lseek(fin.fileno(), data, os.SEEK_HOLE)
                while data < hole:
                    data += os.copy_file_range(fin.fileno(), fd, hole - data, data, data)
                offset = hole
            os.ftruncate(fd, st.st_size)
            os.fchmod(fd, st.st_mode & 0o7777)
        finally:
            os.close(fd)


def tree_name(bundle: str) -> str:
    """The bundle's tree name: its content's (manifest.json and inputs.sha256, which
    bundle.py writes from every input), so a rebuilt bundle is a new tree."""
    digest = hashlib.sha256()
    for name in ("manifest.json", "inputs.sha256"):
        try:
            with open(os.path.join(bundle, name), "rb") as f:
                digest.update(name.encode() + b"\0" + f.read() + b"\0")
        except FileNotFoundError:
            pass
    return digest.hexdigest()[:trees.NAME_LENGTH]


def same_content(bundle: str, tree: str) -> bool:
    for name in ("manifest.json", "inputs.sha256"):
        paths = (os.path.join(bundle, name), os.path.join(tree, name))
        blobs = []
        for path in paths:
            try:
                with open(path, "rb") as f:
                    blobs.append(f.read())
            except FileNotFoundError:
                blobs.append(None)
        if blobs[0] != blobs[1]:
            return False
    return True


def relocate(staged: str, tree: str) -> None:
    """The bundle copied to `staged` made to run from `tree` (/opt/podvm/<name>): each
    executable's loader is the tree's own lib/ld.so (not a link through `current`,
    which would hand an old shim's next QEMU a new loader), each script's #! the tree's
    Python."""
    old_loader = f"{PREFIX}/lib/ld.so"
    for sub in RELOCATED:
        directory = os.path.join(staged, sub)
        if not os.path.isdir(directory):
            continue
        for name in sorted(os.listdir(directory)):
            path = os.path.join(directory, name)
            if os.path.islink(path) or not os.path.isfile(path):
                continue
            with open(path, "rb") as f:
                head = f.read(4096)
            if head.startswith(b"\x7fELF"):
                with open(path, "rb") as f:
                    data = f.read()
                try:
                    loader = elfpatch.interpreter(data)
                except elfpatch.ElfPatchError:
                    continue
                if loader == old_loader:
                    elfpatch.set_interpreter(path, f"{tree}/lib/ld.so")
            elif head.startswith(b"#!" + PREFIX.encode() + b"/"):
                with open(path, "rb") as f:
                    first, _, rest = f.read().partition(b"\n")
                program, _, args = first[2:].decode().partition(" ")
                line = f"#!{trees.resolve(program, tree)}" + (f" {args}" if args else "")
                mode = os.stat(path).st_mode & 0o7777
                with open(path + ".new", "wb") as f:
                    f.write(line.encode() + b"\n" + rest)
                os.chmod(path + ".new", mode)
                os.rename(path + ".new", path)


def read_note(host: str) -> list[str]:
    """What an uninstall under running pods left for their last shim (trees.RETIRED)."""
    try:
        with open(host + PREFIX + "/" + trees.RETIRED) as f:
            return [line.strip() for line in f.read().splitlines() if line.strip()]
    except FileNotFoundError:
        return []


def point_current(host: str, name: str) -> None:
    """/opt/podvm/current -> `name`, in one step (a new link renamed over the old):
    a shim started from now on resolves the new tree."""
    link = host + CURRENT
    new = link + ".new"
    try:
        os.unlink(new)
    except FileNotFoundError:
        pass
    os.symlink(name, new)
    os.rename(new, link)


def remove(host: str, record: Record, links: tuple[str, ...] = ()) -> tuple[list[str],
                                                                           list[str]]:
    """What install wrote, `current`, the trees no process uses, then the directories it
    made (only if empty: what someone else put there stays); returns the paths left and
    the trees still in use. Trees in use stay, with `current` and `links` (containerd
    finds a running pod's shim again through its link), and a note (trees.RETIRED)
    naming those links and the directories install made: the last of their shims to exit
    removes them (podvm_core/treegc.py)."""
    prefix = host + PREFIX
    kept = [p for p in record.files if p in links]
    note = [*kept, *record.directories]
    fd = None
    if trees.names(prefix):
        with open(prefix + "/" + trees.RETIRED + ".new", "w") as f:
            f.write("".join(p + "\n" for p in note))
        os.rename(prefix + "/" + trees.RETIRED + ".new", prefix + "/" + trees.RETIRED)
        fd = treegc.lock(host)  # a shim exiting meanwhile waits, then sees what is left
    try:
        treegc.collect(host, keep_current=False)
        in_use = trees.names(prefix)
        if in_use:
            try:
                current = os.readlink(host + CURRENT)
            except OSError:
                current = ""
            if current not in in_use:
                point_current(host, in_use[-1])
        else:
            kept = []
            treegc.finish(host, [])
        for path in [*record.files, RECORD]:
            if path not in kept:
                try:
                    os.unlink(host + path)
                except FileNotFoundError:
                    pass
    finally:
        if fd is not None:
            os.close(fd)
    left = []
    for directory in reversed(record.directories):
        if in_use and any((p + "/").startswith(directory + "/") for p in [PREFIX, *kept]):
            continue  # the note's: the last shim removes it
        try:
            os.rmdir(host + directory)
        except FileNotFoundError:
            pass
        except OSError:
            left.append(directory)
    return left, [f"{PREFIX}/{n}" for n in in_use]
