"""QEMU driver: a pod's VM started (booted, or restored from a template's state) with
the command line of shim/vm/qemu/command.py, confined (jail.py), its file server beside
it (shim/vm/virtiofsd.py), attached over QMP (monitor.py, which also hears QEMU stop
the VM unasked), and stopped or killed. What it does over QMP once running is in query.py
(size, threads), hotplug.py and state.py (save and load); what the user is told when it
fails, in diagnosis.py."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import subprocess
from typing import Callable

import psutil
from qemu.qmp import ExecuteError, QMPClient, QMPError

from ...host.processes import end_child, ended, peek_exit
from ...libc import descriptor_table, libc, no_huge_pages
from .. import scratchdisk, workdir
from ..hypervisor import (BootTimeout, HypervisorError, MemoryAhead, RestoreFailed, SavedVM,
                          ThreadRole, VM, VMExited, VMSpec)
from ..virtiofsd import FileServer, virtio_fs_socket
from ..vmmlog import PipeLog, tail
from . import command, diagnosis, hotplug, jail, query, state
from .console import ConsoleLog
from .jailid import JailId
from .monitor import RunWatch, connect, disconnect

# What a QMP call or the agent's first connection raises when QEMU dies under it.
VANISHED = (QMPError, OSError, EOFError, asyncio.IncompleteReadError)

log = logging.getLogger("podvm.qemu")

LOADING = "QEMU was loading the template's state"

class QemuVM(VM):
    def __init__(self, spec: VMSpec) -> None:
        self.spec = spec
        self._proc: asyncio.subprocess.Process | None = None
        self._qmp: QMPClient | None = None
        self._agent_stream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        self._booted = False
        self._boot_stage = "QEMU starting"  # where launch() is: said when it times out
        self._restore_from: SavedVM | None = None
        self._console: ConsoleLog | None = None
        self._stderr: PipeLog | None = None  # qemu.log, at a bounded size
        self._files: FileServer | None = None
        self._memory: asyncio.Future[str] | None = None
        self._jail = JailId(spec)  # the uid and gid QEMU runs as, claimed at launch
        self._run = RunWatch(spec.sandbox_id)

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise HypervisorError(f"VM of sandbox {self.spec.sandbox_id} was never launched")
        return self._proc.pid

    @property
    def agent_socket(self) -> str:
        return command.agent_socket(self.spec.workdir)

    def take_agent_stream(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self._agent_stream is None:
            raise HypervisorError(f"VM of sandbox {self.spec.sandbox_id} is not running")
        stream, self._agent_stream = self._agent_stream, None
        return stream

    @property
    def qmp_socket(self) -> str:
        return command.qmp_socket(self.spec.workdir)

    @property
    def control_socket(self) -> str:
        return self.qmp_socket

    @property
    def console_log(self) -> str:
        return command.console_log(self.spec.workdir)

    @property
    def console_socket(self) -> str:  # copied into console_log (shim/vm/qemu/console.py)
        return command.console_socket(self.spec.workdir)

    def command(self) -> list[str]:
        return command.command(self.spec)

    def check_files(self) -> None:
        diagnosis.check_files(self.spec)

    @property
    def jail_id(self) -> int | None:
        return self._jail.number

    @property
    def helper_pids(self) -> list[int]:
        return self._files.pids() if self._files is not None else []

    async def launch(self, preexec=None, restore_from: SavedVM | None = None,
                     memory: MemoryAhead | None = None) -> None:
        """`restore_from`: a template's saved VM (shim/vm/template/template.py) that QEMU
        loads instead of booting the guest; RestoreFailed when that fails."""
        self.check_files()
        os.makedirs(self.spec.workdir, mode=0o700, exist_ok=True)
        if self.spec.hypervisor.enable_jail:
            self._jail.claim()
        for path in (self.agent_socket, self.qmp_socket):
            workdir.unlink(path)
        self._restore_from = restore_from
        memfd = disk = -1
        try:
            # The RAM's copy first: a restore's longest step, which all the rest overlaps.
            memfd, self._memory = state.open_memory(self.spec, restore_from, preexec,
                                                         memory)
            if self.spec.hypervisor.shared_fs == "virtio-fs" and not self.spec.saved:
                self._files = FileServer(self.spec)
                self._files.start_soon(preexec)
                if not restore_from:  # a booted QEMU connects to it as it starts
                    await self._files.ready()
                    self._jail.give_socket(virtio_fs_socket(self.spec.workdir))
            disk = scratchdisk.open_for(self.spec.hypervisor)
            # descriptors: no path of the guest's RAM or of its disk is in the jail
            self.spec = dataclasses.replace(
                self.spec, memory_path=f"/proc/self/fd/{memfd}" if memfd >= 0 else
                self.spec.memory_path, scratch_disk=f"/proc/self/fd/{disk}" if disk >= 0 else "")
            for fd in (memfd, disk):
                if fd >= 0:
                    self._jail.give(fd)
            await self._spawn(preexec, [fd for fd in (memfd, disk) if fd >= 0])
        except BaseException:
            await self._stop_helpers()
            if self._proc is None or self._proc.returncode is not None:
                self._jail.release()
            raise
        finally:
            for fd in (memfd, disk):
                if fd >= 0:
                    os.close(fd)  # QEMU (and the memory's copy) have their own

    async def _spawn(self, preexec: Callable[[], None] | None, fds: list[int]) -> None:
        """QEMU started, confined, and attached until the guest's agent port is open."""
        restore_from = self._restore_from
        cmd = self.command() + (["-incoming", "defer"] if restore_from else [])
        log.info("starting QEMU: %s", " ".join(cmd))
        libc()  # loaded before the fork: the child only calls it
        confine = jail.plan(self.spec, self._jail.number) \
            if self._jail.number is not None else None
        if confine is not None:
            os.makedirs(confine.root, mode=0o700, exist_ok=True)

        def child() -> None:
            no_huge_pages()
            descriptor_table()
            if preexec is not None:
                preexec()  # first: it writes cgroup files the jail hides
            if confine is not None:
                jail.enter_or_say(confine)

        stderr = self._stderr = PipeLog(os.path.join(self.spec.workdir, "qemu.log"))
        try:
            self._proc = await asyncio.create_subprocess_exec(
                *cmd, stdin=asyncio.subprocess.DEVNULL, stdout=stderr, stderr=stderr,
                start_new_session=True, preexec_fn=child,
                pass_fds=[*fds, *(fd for nic in self.spec.nics for fd in nic.fds)])
        except OSError as exc:
            raise HypervisorError(f"cannot run {cmd[0]}: {exc.strerror}") from None
        except subprocess.SubprocessError:  # what the child said is in qemu.log
            stderr.close()
            stderr.drain()
            raise HypervisorError(f"cannot start QEMU of sandbox {self.spec.sandbox_id}: "
                                  f"{diagnosis.qemu_log_tail(self.spec)}") from None
        finally:
            stderr.close()
        try:
            await self._guest_up()
        except HypervisorError as exc:  # QEMU is stopped
            # QEMU refusing the state ends it with status 1; a kill, a timeout, a crash is
            # not the template's fault and fails the pod as it would a boot.
            refused = self._proc.returncode is not None and self._proc.returncode > 0
            if restore_from and self._boot_stage == LOADING and refused:
                raise RestoreFailed(f"the template {restore_from.state} did not restore: "
                                    f"{exc}") \
                    from None
            raise

    async def _guest_up(self) -> None:
        """Until the agent's port is open; QEMU stopped and the error said as the user
        needs it when it does not get there."""
        try:
            async with asyncio.timeout(self.spec.hypervisor.boot_timeout):
                await self._first_of(self._attach_and_boot(), self._exited_early())
        except TimeoutError:
            where = await diagnosis.vcpu_positions(self._qmp) if self._qmp else ""
            await self.stop(timeout=0)
            raise BootTimeout(diagnosis.boot_timeout(self.spec, self._boot_stage) +
                              where) from None
        except VANISHED as exc:
            # QEMU died under the QMP handshake (an abort at start reads as EOF there):
            # its exit, not the broken socket, is what the user needs to hear about.
            gone = await self.exited(grace=2)
            await self.stop(timeout=0)
            if gone is not None:
                raise gone from None
            raise HypervisorError(f"cannot attach to QEMU of sandbox {self.spec.sandbox_id}: "
                                  f"{type(exc).__name__}: {exc}; QEMU said: "
                                  f"{diagnosis.qemu_log_tail(self.spec)}; "
                                  f"{diagnosis.accel_hint(self.spec)}") from None
        except BaseException:
            await self.stop(timeout=0)
            raise

    @staticmethod
    async def _first_of(*coros) -> None:
        tasks = [asyncio.ensure_future(c) for c in coros]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _exited_early(self) -> None:
        assert self._proc is not None
        await self._proc.wait()
        gone = await self.exited()
        assert gone is not None
        raise gone

    async def exited(self, grace: float = 0) -> VMExited | None:
        proc = self._proc
        if proc is None:
            return None
        status = proc.returncode if proc.returncode is not None else peek_exit(proc.pid)
        if status is None and grace > 0:
            try:
                await asyncio.wait_for(proc.wait(), grace)
            except TimeoutError:
                pass
            status = proc.returncode
        if status is None:
            return None
        if self._console is not None:  # its last lines, which the message quotes
            await self._console.finished(grace=1)
        if self._stderr is not None:
            self._stderr.drain()
        return diagnosis.exited(self.spec, proc.pid, status, self._booted)

    async def _attach_and_boot(self) -> None:
        qmp = QMPClient(f"podvm-{self.spec.sandbox_id}")
        self._boot_stage = "QEMU had not opened its QMP socket"
        def opened() -> None:
            self._boot_stage = "QEMU had not answered the QMP handshake"
        await connect(qmp, self.qmp_socket, opened)
        self._qmp = qmp
        # Before the guest runs, or restores: QEMU drops console output nobody reads.
        self._boot_stage = "the console socket of QEMU did not accept"
        self._console = await ConsoleLog.attach(
            self.console_socket, self.console_log,
            self.spec.hypervisor.console_log_max_kib << 10)
        # Connected before the guest runs: a guest that opens its port while the host
        # side is unconnected reads end-of-file.
        self._boot_stage = "the agent socket of QEMU did not accept"
        with workdir.socket_path(self.agent_socket) as sock:
            self._agent_stream = await asyncio.open_unix_connection(sock)
        if self._restore_from:
            # The guest's port is open in the state loaded: nothing to wait for after cont.
            self._boot_stage = LOADING
            assert self._memory is not None  # the guest's RAM, copied and checked meanwhile
            await state.load(qmp, self._execute, self._restore_from, self._memory)
            if self._files is not None:
                self._boot_stage = "the pod's virtiofsd was starting"
                await self._files.ready()
                self._jail.give_socket(virtio_fs_socket(self.spec.workdir))
                self._boot_stage = "QEMU did not add the virtio-fs device"
                await hotplug.add_virtio_fs(self._execute, self.spec.workdir)
            self._boot_stage = "QEMU did not start the vCPUs (QMP cont)"
            await qmp.execute("cont")
            log.info("guest agent port open (restored from %s)", self._restore_from.state)
            self._booted = True
            return
        with qmp.listener(names=("VSERPORT_CHANGE",)) as port_events:
            self._boot_stage = "QEMU did not start the vCPUs (QMP cont)"
            await qmp.execute("cont")
            self._boot_stage = "the guest ran but never opened its agent port"
            async for event in port_events:
                data = event.get("data", {})
                if data.get("id") == "agentport" and data.get("open"):
                    log.info("guest agent port open")
                    self._booted = True
                    return

    async def save(self, path: str) -> None:
        """The VM stopped and its state written to `path` (shim/vm/qemu/state.py)."""
        self._run.saving = True  # a stop of the shim's own
        await state.save(self._send_fd, self._execute, path)

    async def unasked_stop(self) -> str:
        """shim/vm/qemu/monitor.py."""
        await self._execute("query-status")  # QEMU gone: how it ended, raised
        assert self._qmp is not None
        return await self._run.unasked_stop(self._qmp, self._execute)

    def kill(self) -> None:
        if self._proc is not None and self._proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.kill()

    def _send_fd(self, fd: int) -> None:
        assert self._qmp is not None
        self._qmp.send_fd_scm(fd)

    def console_tail(self, size: int = 2000) -> str:
        return tail(self.console_log, size) or "(nothing)"

    async def threads(self) -> dict[ThreadRole, list[int]]:
        try:
            roles = await query.threads(self._execute, self.pid)
        except psutil.NoSuchProcess:
            raise (await self.exited(grace=2)) or HypervisorError("QEMU is gone") from None
        if self._files is not None:
            roles[ThreadRole.FILES] = self._files.threads()
        return roles

    async def _execute(self, command: str, arguments: dict | None = None) -> object:
        """One QMP command. QEMU refusing it raises ExecuteError (the caller says what
        was refused); QEMU gone raises VMExited with its last words."""
        if self._qmp is None:
            raise (await self.exited()) or HypervisorError(
                f"VM of sandbox {self.spec.sandbox_id} is not running")
        try:
            return await self._qmp.execute(command, arguments)
        except ExecuteError:
            raise
        except VANISHED as exc:
            raise (await self.exited(grace=2)) or HypervisorError(
                f"QMP {command} to QEMU of sandbox {self.spec.sandbox_id} failed: "
                f"{type(exc).__name__}: {exc}") from None

    async def size(self) -> tuple[int, int]:
        return await query.size(self._execute)

    async def add_vcpus(self, count: int) -> list[int]:
        """No unplug, and no free slot under TCG: shim/vm/qemu/hotplug.py."""
        return await hotplug.add_vcpus(self._execute, count)

    async def add_memory(self, mib: int) -> int:
        return await hotplug.add_memory(self._execute, mib, self.spec.max_memory_mib)

    async def resize_scratch(self, size_bytes: int) -> None:
        await self._execute("block_resize", {"node-name": command.SCRATCH, "size": size_bytes})

    async def stop(self, timeout: float = 10) -> None:
        proc = self._proc
        if proc is not None and proc.returncode is None and timeout > 0 and self._qmp:
            try:
                await asyncio.wait_for(self._qmp.execute("quit"), timeout)
            except Exception as exc:
                log.debug("QMP quit: %s", exc)
        qmp, self._qmp = self._qmp, None
        await disconnect(qmp)
        if self._agent_stream is not None:  # never taken
            self._agent_stream[1].close()
            self._agent_stream = None
        if proc is not None:
            await end_child(proc, timeout, "QEMU")
        if self._stderr is not None and proc is not None and proc.returncode is not None:
            self._stderr.drain()  # its last words, for the messages that quote them
        if self._console is not None:
            console, self._console = self._console, None
            await console.close()
        await self._stop_helpers()
        self._jail.release()
        for path in (self.agent_socket, self.qmp_socket, self.console_socket):
            workdir.unlink(path)

    async def _stop_helpers(self) -> None:
        """The RAM copy and virtiofsd (which ends by itself once QEMU has hung up)."""
        if self._memory is not None:
            memory, self._memory = self._memory, None
            memory.cancel()
            await asyncio.gather(memory, return_exceptions=True)
        if self._files is not None:
            await self._files.stop()

    def dead(self) -> bool:
        return self._proc is not None and ended(self._proc)

    async def wait(self) -> int:
        if self._proc is None:
            raise HypervisorError("VM was never launched")
        return await self._proc.wait()


