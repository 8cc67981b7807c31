"""A template's saved state into QEMU through a descriptor: QEMU runs under its seccomp
sandbox (spawn=deny) in a jail where the template is no path, so it cannot run a reader
itself (migrate-incoming `exec:`). The shim starts the reader, dd, in the pod's sandbox
cgroup (the same preexec as QEMU's), writing into a pipe whose read end QEMU gets over
QMP (getfd) and loads with `fd:`. dd reads past the host's page cache (O_DIRECT), so what
a pod's QEMU loads is not charged to the cgroup of the first pod that read the file;
where the file system has no O_DIRECT (tmpfs), it drops what it read instead."""
from __future__ import annotations

import asyncio
import errno
import os
import signal
from typing import Awaitable, Callable

from .hypervisor import RestoreFailed

FD_NAME = "template"


def reader_command(path: str) -> list[str]:
    """dd's command line for `path`; RestoreFailed when it is gone (discarded by another
    pod meanwhile)."""
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC))
        how = "iflag=direct"
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise RestoreFailed(f"cannot read the template {path}: {exc.strerror}") from None
        how = "iflag=nocache"
    return ["dd", f"if={path}", "bs=4M", how, "status=none"]


async def load(path: str, send_fd: Callable[[int], Awaitable[None]],
               loaded: Callable[[], Awaitable[None]],
               preexec: Callable[[], None] | None) -> None:
    """Start dd on `path` into a pipe, hand its read end to QEMU (`send_fd`: getfd
    named FD_NAME, then migrate-incoming), wait for `loaded`; RestoreFailed, with dd's
    words, when dd fails. dd is gone when this returns."""
    command = reader_command(path)
    read, write = os.pipe2(os.O_CLOEXEC)
    try:
        reader = await asyncio.create_subprocess_exec(
            *command, stdin=asyncio.subprocess.DEVNULL, stdout=write,
            stderr=asyncio.subprocess.PIPE, preexec_fn=preexec)
    except OSError as exc:
        os.close(read)
        raise RestoreFailed(f"cannot run dd for the template {path}: {exc.strerror}") \
            from None
    finally:
        os.close(write)
    try:
        try:
            await send_fd(read)
        finally:
            os.close(read)  # QEMU has its own copy (or none: it refused)
        await _first(loaded(), reader, path)
    finally:
        if reader.returncode is None and not await _ended(reader):
            reader.kill()
        await reader.wait()


async def _first(loaded: Awaitable[None], reader: asyncio.subprocess.Process,
                 path: str) -> None:
    """The load's end, or dd's failure, whichever comes first: a pipe closed before any
    data (dd could not open the file) is a hang-up without input, which QEMU 7.2's
    incoming migration never notices."""
    load = asyncio.ensure_future(loaded)
    ended = asyncio.ensure_future(reader.wait())
    try:
        await asyncio.wait({load, ended}, return_when=asyncio.FIRST_COMPLETED)
        # All written, or QEMU stopped reading (its own error says why): it ends it.
        if not load.done() and reader.returncode in (0, -signal.SIGPIPE):
            await load
        if load.done():
            load.result()
            return
        assert reader.stderr is not None
        said = (await reader.stderr.read()).decode(errors="replace").strip()
        raise RestoreFailed(f"dd could not read the template {path} (status "
                            f"{reader.returncode}): {said or 'no message'}")
    finally:
        for task in (load, ended):
            task.cancel()
        await asyncio.gather(load, ended, return_exceptions=True)


async def _ended(proc: asyncio.subprocess.Process, grace: float = 2) -> bool:
    """dd ends by itself once QEMU took the whole stream or closed the pipe."""
    try:
        await asyncio.wait_for(proc.wait(), grace)
        return True
    except TimeoutError:
        return False
