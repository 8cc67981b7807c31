"""PID 1 reaps every child: runc, container inits that runc leaves behind, exec'd
processes. One SIGCHLD handler collects every exit; callers wait by pid. An exit that
comes before anyone asks is kept until asked for."""
from __future__ import annotations

import asyncio
import os
import signal

from podvm_core.fdio import FdStream


class Reaper:
    def __init__(self) -> None:
        self._waiters: dict[int, asyncio.Future[int]] = {}
        self._early: dict[int, int] = {}

    def install(self) -> None:
        asyncio.get_running_loop().add_signal_handler(signal.SIGCHLD, self.reap)

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            code = os.waitstatus_to_exitcode(status)
            code = 128 - code if code < 0 else code
            future = self._waiters.pop(pid, None)
            if future is not None and not future.done():
                future.set_result(code)
            else:
                self._early[pid] = code

    def watch(self, pid: int) -> asyncio.Future[int]:
        """A future with the exit status (128+n when killed by signal n)."""
        future = self._waiters.get(pid)
        if future is None:
            future = asyncio.get_running_loop().create_future()
            if pid in self._early:
                future.set_result(self._early.pop(pid))
            else:
                self._waiters[pid] = future
        return future


REAPER = Reaper()


async def run(argv: list[str], stdin: int | None = None, stdout: int | None = None,
              stderr: int | None = None, capture: bool = True) -> tuple[int, bytes, bytes]:
    """Run a program through the reaper (asyncio's own child watching would race with
    PID 1's reaping). Unset stdio is captured (or /dev/null when capture is False)."""
    pipes: dict[int, int] = {}
    actions = []
    devnull = os.open(os.devnull, os.O_RDWR)
    close_after: list[int] = [devnull]
    for target, given in ((0, stdin), (1, stdout), (2, stderr)):
        if given is not None:
            actions.append((os.POSIX_SPAWN_DUP2, given, target))
        elif target == 0 or not capture:
            actions.append((os.POSIX_SPAWN_DUP2, devnull, target))
        else:
            r, w = os.pipe()
            pipes[target] = r
            close_after.append(w)
            actions.append((os.POSIX_SPAWN_DUP2, w, target))
    try:
        pid = os.posix_spawn(argv[0], argv, os.environ, file_actions=actions)
    finally:
        for fd in close_after:
            os.close(fd)
    status = REAPER.watch(pid)
    outputs = await asyncio.gather(*(_read_all(fd) for fd in (pipes.get(1), pipes.get(2))))
    return await status, outputs[0], outputs[1]


async def _read_all(fd: int | None) -> bytes:
    if fd is None:
        return b""
    output = FdStream(fd)
    try:
        return await output.read_all()
    finally:
        output.close()
