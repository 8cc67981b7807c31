"""Files podvm-node puts on the host, and the record of them (HOST/opt/podvm/.installed,
JSON) from which uninstall takes out exactly what install added: the directories it
made, the files it wrote, the bytes it put into containerd's config.toml."""
from __future__ import annotations

import ctypes
import json
import os
import shutil
import stat
from dataclasses import asdict, dataclass, field

from .containerd_dropin import Edit

PREFIX = "/opt/podvm"
RECORD = PREFIX + "/.installed"
AT_FDCWD, RENAME_EXCHANGE = -100, 2


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


def swap_in(staged: str, target: str) -> None:
    """`staged` becomes `target` in one step (renameat2 RENAME_EXCHANGE on an upgrade),
    the old tree is then removed."""
    if not os.path.exists(target):
        os.rename(staged, target)
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.renameat2(AT_FDCWD, staged.encode(), AT_FDCWD, target.encode(),
                      RENAME_EXCHANGE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"exchanging {staged} and {target}: {os.strerror(err)}")
    shutil.rmtree(staged)


def remove(host: str, record: Record) -> list[str]:
    """What install wrote, then the directories it made (only if empty: what someone
    else put there stays); returns the paths left."""
    left = []
    for path in record.files:
        try:
            os.unlink(host + path)
        except FileNotFoundError:
            pass
    shutil.rmtree(host + PREFIX, ignore_errors=True)
    for directory in reversed(record.directories):
        try:
            os.rmdir(host + directory)
        except FileNotFoundError:
            pass
        except OSError:
            left.append(directory)
    return left
