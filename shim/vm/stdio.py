"""A process's stdio: copied between containerd's FIFOs on the host and the guest
agent's stream calls, without blocking the event loop."""
from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from podvm_core.fdio import CHUNK, FdStream
from podvm_core.ttrpc import TtrpcError

if TYPE_CHECKING:
    from podvm_core.pb.agent.agent_pb2 import Stdio as StdioMessage


class Streams(Protocol):
    """The guest agent's stream calls (shim/vm/agent.py's Agent), all a copy needs."""

    async def read(self, stream: str, container_id: str, exec_id: str,
                   max_bytes: int = ...) -> bytes: ...

    async def write_stdin(self, container_id: str, exec_id: str, data: bytes) -> int: ...

    async def close_stdin(self, container_id: str, exec_id: str) -> None: ...

log = logging.getLogger("podvm.stdio")


@dataclass(frozen=True)
class Stdio:
    """Which streams containerd wired: the guest sends the rest to /dev/null."""

    stdin: bool
    stdout: bool
    stderr: bool
    terminal: bool

    @classmethod
    def of(cls, stdin: str, stdout: str, stderr: str, terminal: bool) -> "Stdio":
        return cls(bool(stdin), bool(stdout), bool(stderr) and not terminal, terminal)

    def message(self) -> "StdioMessage":
        # The agent's messages load with a pod's first Create, not in the idle daemon.
        from podvm_core.pb.agent.agent_pb2 import Stdio as StdioMessage

        return StdioMessage(stdin=self.stdin, stdout=self.stdout, stderr=self.stderr,
                            terminal=self.terminal)


class FifoWriter(FdStream):
    """The write end of a FIFO containerd reads. Opened read-write: the open never
    blocks and never fails for want of a reader, and data waits in the pipe."""

    def __init__(self, path: str) -> None:
        self.path = path
        super().__init__(os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC))


class FifoReader(FdStream):
    """The read end of a FIFO containerd writes (stdin)."""

    @classmethod
    async def open(cls, path: str) -> "FifoReader":
        """The one blocking call: a FIFO's read end opens once its writer exists (a
        non-blocking open would see end-of-file before containerd opened its end). It
        waits in a daemon thread, which never holds up the shim's exit."""
        loop = asyncio.get_running_loop()
        opened: asyncio.Future[int] = loop.create_future()

        def blocking_open() -> None:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError as exc:
                loop.call_soon_threadsafe(_settle, opened, None, exc)
                return
            loop.call_soon_threadsafe(_settle, opened, fd, None)

        import threading  # the only thread a shim ever starts, and only for stdin

        threading.Thread(target=blocking_open, name="stdin-open", daemon=True).start()
        return cls(await opened)


class ProcessIO:
    def __init__(self, agent: Streams, container_id: str, exec_id: str, stdin: str,
                 stdout: str, stderr: str, terminal: bool) -> None:
        self._agent = agent
        self._ids = (container_id, exec_id)
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr
        self.terminal = terminal
        self._outputs: list[asyncio.Task] = []
        self._input: asyncio.Task | None = None
        self._files: list[FifoWriter | FifoReader] = []

    @property
    def name(self) -> str:
        cid, eid = self._ids
        return f"{cid}/{eid}" if eid else cid

    def start(self) -> None:
        """Begin copying; called once the guest process exists."""
        for stream, path in (("stdout", self.stdout), ("stderr", self.stderr)):
            if path and not (stream == "stderr" and self.terminal):
                writer = FifoWriter(path)
                self._files.append(writer)
                self._outputs.append(asyncio.create_task(self._copy_out(stream, writer)))
        if self.stdin:
            self._input = asyncio.create_task(self._copy_in())

    async def _copy_out(self, stream: str, writer: FifoWriter) -> None:
        try:
            while data := await self._agent.read(stream, *self._ids, CHUNK):
                await writer.write(data)
        except TtrpcError as exc:
            log.debug("%s of %s ended: %s", stream, self.name, exc)
        finally:
            writer.close()

    async def _copy_in(self) -> None:
        reader = await FifoReader.open(self.stdin)
        self._files.append(reader)
        try:
            while data := await reader.read():
                await self._agent.write_stdin(*self._ids, data)
            await self._agent.close_stdin(*self._ids)
        except TtrpcError as exc:
            log.debug("stdin of %s ended: %s", self.name, exc)
        finally:
            reader.close()

    async def close_stdin(self) -> None:
        if self._input is not None and not self._input.done():
            self._input.cancel()
        await self._agent.close_stdin(*self._ids)

    async def drained(self, timeout: float = 2.0) -> None:
        """Wait until the outputs reached end-of-file (after the process exited); give up
        after `timeout`, since a left-over child may hold them open."""
        if not self._outputs:
            return
        done, pending = await asyncio.wait(self._outputs, timeout=timeout)
        if pending:
            log.info("output of %s still open %.1fs after exit: closing it", self.name,
                     timeout)

    async def close(self) -> None:
        if self._input is not None and not self._input.done():
            _release_blocked_open(self.stdin)
        tasks = [*self._outputs, *([self._input] if self._input else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for f in self._files:
            f.close()


def _release_blocked_open(path: str) -> None:
    """A read-side open still waiting for containerd's writer returns once any writer
    appears: be that writer for a moment."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC))
    except OSError:
        pass  # no open is waiting (ENXIO) or the FIFO is gone


def _settle(future: asyncio.Future, fd: int | None, exc: BaseException | None) -> None:
    if future.cancelled():
        if fd is not None:
            os.close(fd)  # opened after the process was gone: nobody reads it
    elif exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(fd)
