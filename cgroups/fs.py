"""Reading and writing cgroup files the way the kernel expects (one write per value),
with errors that name the file, and a transaction that puts old values back when a later
write is refused, so a limit change is applied whole or not at all."""
from __future__ import annotations

import errno
import os
import time
from typing import Callable

from .errors import CgroupBusy, CgroupError, CgroupIOError, ProcessGone

RMDIR_TIMEOUT = 2.0
"""Seconds to wait for a cgroup whose last task is still exiting."""
EVACUATE_TIMEOUT = 30.0
"""Seconds to keep moving tasks out of a cgroup: a task that is exiting cannot be moved
(the kernel skips it without an error) and leaves only when its exit is done, which a
busy machine can make slow for a VMM with a large address space."""


def read_value(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError as err:
        raise CgroupIOError("read", path, err) from None


def read_optional(path: str) -> str | None:
    """None when the file is not there (a controller that is not enabled)."""
    try:
        return read_value(path)
    except CgroupIOError as err:
        if err.errno == errno.ENOENT:
            return None
        raise


def write_value(path: str, value: str) -> None:
    # A zero-length write never reaches the kernel's handler; "\n" is how an empty value
    # (cgroup v2's "inherit the parent's cpuset") is written.
    data = value.encode() or b"\n"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    except OSError as err:
        raise CgroupIOError("write", path, err, value) from None
    try:
        os.write(fd, data)
    except OSError as err:
        raise CgroupIOError("write", path, err, value) from None
    finally:
        os.close(fd)


def write_id(path: str, ident: int) -> None:
    """A pid or tid into cgroup.procs / tasks / cgroup.threads; ProcessGone when it has
    exited (ESRCH), which callers sorting live threads expect and skip."""
    try:
        write_value(path, str(ident))
    except CgroupIOError as err:
        if err.errno == errno.ESRCH:
            raise ProcessGone(f"task {ident} has exited ({path})") from None
        raise


def read_ids(path: str) -> list[int]:
    """A tasks / cgroup.procs / cgroup.threads file; [] when the cgroup is gone."""
    text = read_optional(path)
    return [int(line) for line in text.split()] if text else []


def evacuate(members: Callable[[], list[int]], move: Callable[[int], None], what: str,
             timeout: float = EVACUATE_TIMEOUT) -> None:
    """Move every member (`members()` reads them now) out with `move`, none killed, until
    none is left; with short pauses, since exiting tasks stay listed until they are gone.
    CgroupError, naming what is left, after `timeout`."""
    deadline = time.monotonic() + timeout
    delay = 0.001
    while ids := members():
        if time.monotonic() >= deadline:
            raise CgroupError(f"{what} still has tasks {' '.join(map(str, ids[:8]))} after "
                              f"{timeout:.0f}s of moving them out")
        for ident in ids:
            move(ident)
        if members():
            time.sleep(delay)
            delay = min(delay * 2, 0.05)


def make_dir(path: str) -> bool:
    """True when this call created it."""
    try:
        os.mkdir(path)
        return True
    except FileExistsError:
        return False
    except OSError as err:
        raise CgroupIOError("mkdir", path, err) from None


def remove_dir(path: str, timeout: float = RMDIR_TIMEOUT) -> bool:
    """True when this call removed it, False when it was already gone. A cgroup whose
    tasks are still exiting answers EBUSY for a moment; retry until `timeout`."""
    deadline = time.monotonic() + timeout
    delay = 0.005
    while True:
        try:
            os.rmdir(path)
            return True
        except FileNotFoundError:
            return False
        except OSError as err:
            if err.errno != errno.EBUSY or time.monotonic() >= deadline:
                cls = CgroupBusy if err.errno == errno.EBUSY else CgroupIOError
                raise cls("rmdir", path, err) from None
        time.sleep(delay)
        delay = min(delay * 2, 0.1)


class NewDirectories:
    """The directories one step makes, removed again (newest first) when the step fails,
    so a failed create leaves nothing behind."""

    def __init__(self) -> None:
        self.made: list[str] = []

    def make(self, path: str) -> None:
        if make_dir(path):
            self.made.append(path)

    def __enter__(self) -> NewDirectories:
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None,
                 tb: object) -> None:
        if exc is None:
            return
        for path in reversed(self.made):
            try:
                remove_dir(path, timeout=0)
            except CgroupError:
                pass


class Transaction:
    """Writes in order; on an error leaving the `with` block the writes done are undone,
    newest first, which walks back through the same intermediate states (each of them one
    the kernel accepted)."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []

    def __enter__(self) -> Transaction:
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None,
                 tb: object) -> None:
        if exc is None:
            self._undo.clear()
            return
        failed = self.rollback()
        if failed:
            raise CgroupError(f"{exc}; and restoring the old values failed: "
                              f"{'; '.join(map(str, failed))}") from exc

    def write_if_changed(self, path: str, value: str) -> None:
        if read_value(path) != value:
            self.write(path, value)

    def write(self, path: str, value: str) -> None:
        old = read_value(path)
        write_value(path, value)
        self._undo.append(lambda: write_value(path, old))

    def step(self, do: Callable[[], None], undo: Callable[[], None]) -> None:
        do()
        self._undo.append(undo)

    def rollback(self) -> list[CgroupIOError]:
        """Best effort: returns what could not be restored."""
        failed: list[CgroupIOError] = []
        while self._undo:
            try:
                self._undo.pop()()
            except CgroupIOError as err:
                failed.append(err)
        return failed
