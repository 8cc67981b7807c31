"""Files that hold either their old content or the new, never a part: what a crash at
any moment may leave is what `delete` and the next writer read.

`replace_at` and `write_atomic_at` work beneath a directory descriptor and never follow
a link: for a directory a less trusted process can write (QEMU's work directory, where
a planted `console.log.<pid>.tmp -> /etc/cron.d/x` would otherwise have the shim write
a crontab). The temporary file is made new (O_EXCL, O_NOFOLLOW) under a name nobody can
guess, and renamed over the name, which replaces whatever was there (a link, a FIFO)
without opening it."""
from __future__ import annotations

import os

from . import lightjson

_TRIES = 16  # names taken by someone else before one of ours is free: then EEXIST


def replace_at(dirfd: int, name: str, data: bytes = b"", durable: bool = False,
               mode: int = 0o666) -> int:
    """`name` in `dirfd` replaced in one rename by a new file holding `data`: the new
    file's descriptor (read-write, at its end), which the caller closes."""
    fd, tmp = _new_file(dirfd, name, mode)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        if durable:
            os.fsync(fd)
        os.rename(tmp, name, src_dir_fd=dirfd, dst_dir_fd=dirfd)
    except BaseException:
        os.close(fd)
        try:
            os.unlink(tmp, dir_fd=dirfd)
        except FileNotFoundError:
            pass
        raise
    return fd


def _new_file(dirfd: int, name: str, mode: int) -> tuple[int, str]:
    """A file made new beside `name`, and its name: `<name>.<pid>.tmp` (a writer that
    died leaves that, which sweeps know), another name where that is taken."""
    pid = os.getpid()
    for attempt in range(_TRIES):
        # os.urandom, not secrets: that module (with hmac, hashlib, random) would be
        # most of what `start` and `delete` import.
        tmp = f"{name}.{pid}.tmp" if attempt == 0 else \
            f"{name}.{pid}.{os.urandom(8).hex()}.tmp"
        try:
            return os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW |
                           os.O_CLOEXEC, mode, dir_fd=dirfd), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name beside {name} after {_TRIES} tries")


def write_atomic_at(dirfd: int, name: str, data: bytes, durable: bool = False) -> None:
    """Replace `name` in `dirfd` with `data` in one rename, following no link."""
    os.close(replace_at(dirfd, name, data, durable))


def write_atomic(path: str, data: bytes, durable: bool = False) -> None:
    """Replace `path` with `data` in one rename. `durable`: the data reaches the disk
    before the rename (for state other processes trust after a power loss)."""
    dirfd = os.open(os.path.dirname(path) or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        write_atomic_at(dirfd, os.path.basename(path), data, durable)
    finally:
        os.close(dirfd)


def write_json(path: str, value: object, durable: bool = False, **dump_args) -> None:
    if dump_args:
        # Here, not at the top: json's own modules (re, enum) for the options alone;
        # lightjson writes the same text without them (`start` writes shim.json)
        import json

        text = json.dumps(value, **dump_args)
    else:
        text = lightjson.dumps(value)
    write_atomic(path, text.encode(), durable)
