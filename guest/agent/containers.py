"""Containers and processes inside the guest, with the stdio the host reads and writes."""
from __future__ import annotations

import asyncio
import json
import os
import socket
import time

from podvm_core.pb.agent import agent_pb2 as pb
from podvm_core.procstate import Lifecycle, pick
from podvm_core.ttrpc import Code, TtrpcError

from . import runc
from .reaper import REAPER
from .streams import Stream


class Process(Lifecycle):
    """A process in the guest, in the states the shim keeps it in (procstate): created
    until runc starts it, running, paused with its container, stopped once reaped.
    Made as Lifecycle is; its stdio is set once runc has started it. A plain class,
    not a dataclass: making one costs the agent's start ~20 ms under TCG."""

    stdin: Stream | None = None
    stdout: Stream | None = None
    stderr: Stream | None = None
    pty: Stream | None = None
    killed_by = 0
    """The signal the agent sent a namespace holder (holder.py), for its exit status."""

    def stream(self, name: str) -> Stream | None:
        if self.pty is not None:
            return self.pty if name in ("stdout", "stdin") else None
        return getattr(self, name)

    def follow(self) -> None:
        """Record the exit when the reaper sees it."""
        REAPER.watch(self.pid).add_done_callback(
            lambda future: self.set_exited(future.result(), time.time_ns()))

    def close(self) -> None:
        for s in (self.stdin, self.stdout, self.stderr, self.pty):
            if s is not None:
                s.close()


class Container:
    def __init__(self, id: str, sandbox: bool, init: Process, holder: bool = False) -> None:
        self.id = id
        self.sandbox = sandbox
        self.init = init
        self.execs: dict[str, Process] = {}
        self.holder = holder
        """No runc container: the pod's namespace holder stands in (holder.py)."""
        self.layer_root = ""
        """Its root, when the agent made it over a writable layer of its own
        (writable.py)."""

    def process(self, exec_id: str) -> Process:
        return pick(self.id, self.init, self.execs, exec_id)


class Stdio:
    """The fds runc hands the process, and the agent's ends of them."""

    def __init__(self, want: pb.Stdio) -> None:
        self.want = want
        self.child: list[int] = []
        self.ours: dict[str, int] = {}
        self.console: socket.socket | None = None
        self.console_path = ""
        self._tmp = ""

    def __enter__(self) -> "Stdio":
        if self.want.terminal:
            import tempfile  # only for a terminal: the agent boots without it

            self._tmp = tempfile.mkdtemp(prefix="console-", dir="/run")
            self.console_path = os.path.join(self._tmp, "sock")
            self.console = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.console.bind(self.console_path)
            self.console.listen(1)
            self.console.setblocking(False)
            return self
        for name, child_reads in (("stdin", True), ("stdout", False), ("stderr", False)):
            if getattr(self.want, name):
                r, w = os.pipe()
                child, ours = (r, w) if child_reads else (w, r)
                self.child.append(child)
                self.ours[name] = ours
            else:
                self.child.append(os.open(os.devnull, os.O_RDWR))
        return self

    def fds(self) -> dict[str, int | None]:
        if self.want.terminal:
            return {"stdin": None, "stdout": None, "stderr": None}
        return dict(zip(("stdin", "stdout", "stderr"), self.child))

    async def receive_pty(self) -> Stream:
        assert self.console is not None
        loop = asyncio.get_running_loop()
        conn, _ = await asyncio.wait_for(loop.sock_accept(self.console), 30)
        with conn:
            conn.setblocking(True)
            _, fds, _, _ = await loop.run_in_executor(None, socket.recv_fds, conn, 1024, 1)
        if not fds:
            raise TtrpcError(Code.INTERNAL, "runc sent no terminal")
        return Stream(fds[0])

    def attach(self, proc: Process) -> None:
        for name, fd in self.ours.items():
            setattr(proc, name, Stream(fd))
        self.ours.clear()

    def __exit__(self, *exc: object) -> None:
        for fd in self.child:
            os.close(fd)
        for fd in self.ours.values():
            os.close(fd)
        if self.console is not None:
            self.console.close()
        if self._tmp:
            import shutil  # only for a terminal: the agent boots without it

            shutil.rmtree(self._tmp, ignore_errors=True)


async def _spawn(proc: Process, container_id: str, args: list[str], want: pb.Stdio,
                 pid_file: str) -> None:
    """Run `runc <args>` with the process's stdio (a console socket for a terminal), keep
    the agent's ends on `proc`, and read the pid runc wrote."""
    with Stdio(want) as stdio:
        if want.terminal:
            args = [*args[:-1], "--console-socket", stdio.console_path, args[-1]]
        fds = stdio.fds()
        ran = asyncio.create_task(runc.runc(container_id, *args, stdin=fds["stdin"],
                                            stdout=fds["stdout"], stderr=fds["stderr"]))
        if want.terminal:
            pty = asyncio.create_task(stdio.receive_pty())
            await asyncio.wait([ran, pty], return_when=asyncio.FIRST_EXCEPTION)
            if ran.done() and ran.exception():
                pty.cancel()
                raise ran.exception()  # type: ignore[misc]
            proc.pty = await pty
        await ran
        stdio.attach(proc)
    with open(pid_file) as f:
        proc.pid = int(f.read().strip())


async def create(container_id: str, spec: dict, want: pb.Stdio, sandbox: bool) -> Container:
    bundle = runc.bundle_dir(container_id)
    os.makedirs(bundle, exist_ok=True)
    with open(os.path.join(bundle, "config.json"), "w") as f:
        json.dump(spec, f)
    pid_file = os.path.join(bundle, "init.pid")
    proc = Process(container_id, "")
    # --no-pivot: the guest root is the initramfs, which pivot_root cannot leave;
    # the VM, not the mount namespace, is the isolation boundary here.
    await _spawn(proc, container_id, ["create", "--no-pivot", "--bundle", bundle,
                                      "--pid-file", pid_file, container_id], want, pid_file)
    proc.follow()
    return Container(container_id, sandbox, proc)


async def exec_process(container: Container, exec_id: str, process: dict,
                       want: pb.Stdio) -> Process:
    bundle = runc.bundle_dir(container.id)
    process_file = os.path.join(bundle, f"exec-{exec_id}.json")
    pid_file = os.path.join(bundle, f"exec-{exec_id}.pid")
    process["terminal"] = bool(want.terminal)
    with open(process_file, "w") as f:
        json.dump(process, f)
    proc = Process(container.id, exec_id)
    try:
        async with proc.acting("start"):
            await _spawn(proc, container.id, ["exec", "--detach", "--process", process_file,
                                              "--pid-file", pid_file, container.id], want,
                         pid_file)
    finally:
        for path in (process_file, pid_file):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
    proc.follow()
    return proc
