"""FakeVM: the hypervisor interface (shim/vm/hypervisor.py) without a guest, for the tests
of what the host does with a VM (the shim's APIs, its state machine, cgroups, thread
placement and pinning, resize, exits and cleanup) that need no guest kernel to prove it.

One real host process stands where QEMU would (testbed/fakeguest.py, with "qemu" in its
argv[0] and the control socket on its command line, as `delete` finds a QEMU): `pid`,
`wait`, `exited`, `dead` and `stop` act on it; its threads are real and named as QEMU's
(`threads()` reads them by role, as the QEMU driver does: shim/vm/qemu/query.py, over the
fake's QMP socket), and it hot-plugs vCPUs (new threads) and memory as QEMU does, through
the driver's own shim/vm/qemu/hotplug.py, with QEMU's slots. Its agent
(testbed/fakeagent.py) answers every call of shim/vm/agent.py, running container
processes on the host: unconfined, which is why nothing but a test selects it.

Selected in the shim by PODVM_TEST_VMM=fake in its environment (shim/vm/vmm.py); testbed/
is not installed on nodes, so there the selection fails (docs/threat-model.md)."""
from __future__ import annotations

import asyncio
import os
import pathlib
import signal
import socket
import sys
from typing import Callable

import psutil
from qemu.qmp import ConnectError, ExecuteError, QMPClient, QMPError

from shim.host.processes import end_child, ended, peek_exit
from shim.vm.hypervisor import (BootTimeout, HypervisorError, MemoryAhead, MissingFile,
                                SavedVM, ThreadRole, VM, VMExited, VMSpec)
from shim.vm.qemu import hotplug, query
from shim.vm.qemu.monitor import RunWatch
from shim.vm.vmmlog import PipeLog, tail

PROGRAM = "qemu-system-podvm-fake"
"""The fake guest's argv[0] (in the venv's bin/, so that its Python finds the venv): named
as QEMU is where anything looks for a pod's QEMU by its command line (shim/host/cleanup.py
for a crashed sandbox's, the suite for one left running: tests/conftest.py,
testbed/pods.py), so that those find it too."""
ROOT = str(pathlib.Path(__file__).resolve().parent.parent)
BUSYBOX = "/bin/busybox"
LOG = "fakevm.log"
"""The fake guest's stdout and stderr in the VM's workdir: its console."""
GONE = (QMPError, OSError, EOFError, asyncio.IncompleteReadError)


class FakeVM(VM):
    def __init__(self, spec: VMSpec) -> None:
        self.spec = spec
        self._proc: asyncio.subprocess.Process | None = None
        self._qmp: QMPClient | None = None
        self._agent_stream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        self._log: PipeLog | None = None
        self._booted = False
        self._run = RunWatch(spec.sandbox_id)

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise HypervisorError(f"VM of sandbox {self.spec.sandbox_id} was never launched")
        return self._proc.pid

    @property
    def agent_socket(self) -> str:
        return "(a socketpair: the fake guest inherits its end)"

    @property
    def control_socket(self) -> str:
        return os.path.join(self.spec.workdir, "fake-qmp.sock")

    def command(self) -> list[str]:
        s = self.spec
        return [os.path.join(os.path.dirname(sys.executable), PROGRAM), "-m", "testbed.fakeguest",
                "--name", f"podvm-{s.sandbox_id},debug-threads=on", "--qmp", self.control_socket,
                "--vcpus", str(s.vcpus), "--max-vcpus", str(s.max_vcpus),
                "--memory", str(s.memory_mib), "--max-memory", str(s.max_memory_mib),
                "--accel", s.hypervisor.accel, "--shared-dir", s.shared_dir]

    def check_files(self) -> None:
        if not os.path.isfile(BUSYBOX):
            raise MissingFile(f"{BUSYBOX} does not exist: the fake VM runs containers' "
                              f"commands with it (Debian package busybox)")

    def take_agent_stream(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self._agent_stream is None:
            raise HypervisorError(f"VM of sandbox {self.spec.sandbox_id} is not running")
        stream, self._agent_stream = self._agent_stream, None
        return stream

    async def launch(self, preexec: Callable[[], None] | None = None,
                     restore_from: SavedVM | None = None,
                     memory: MemoryAhead | None = None) -> None:
        if restore_from is not None or memory is not None:
            raise HypervisorError("a fake VM restores no template (set enable_template = "
                                  "false where PODVM_TEST_VMM=fake)")
        self.check_files()
        os.makedirs(self.spec.workdir, mode=0o700, exist_ok=True)
        try:
            os.unlink(self.control_socket)
        except FileNotFoundError:
            pass
        host, guest = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        output = self._log = PipeLog(os.path.join(self.spec.workdir, LOG))
        try:
            self._proc = await asyncio.create_subprocess_exec(
                *self.command(), "--agent-fd", str(guest.fileno()), executable=sys.executable,
                stdin=asyncio.subprocess.DEVNULL, stdout=output, stderr=output,
                start_new_session=True, preexec_fn=preexec, pass_fds=[guest.fileno()],
                env=dict(os.environ, PYTHONPATH=ROOT))
        except BaseException:
            host.close()
            raise
        finally:
            guest.close()
            output.close()
        try:
            self._agent_stream = await asyncio.open_unix_connection(sock=host)
            async with asyncio.timeout(self.spec.hypervisor.boot_timeout):
                await self._first_of(self._attach(), self._exited_early())
        except TimeoutError:
            await self.stop(timeout=0)
            raise BootTimeout(f"the fake guest of sandbox {self.spec.sandbox_id} did not "
                              f"come up within {self.spec.hypervisor.boot_timeout}s; it "
                              f"said: {self.console_tail()}") from None
        except BaseException:
            await self.stop(timeout=0)
            raise
        self._booted = True

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

    async def _attach(self) -> None:
        """QMP connected (the fake guest opens it once its agent serves) and `cont`."""
        qmp = QMPClient(f"podvm-fake-{self.spec.sandbox_id}")
        while True:
            if not os.path.exists(self.control_socket):
                await asyncio.sleep(0.01)
                continue
            try:
                await qmp.connect(self.control_socket)
                break
            except ConnectError as exc:
                if not isinstance(exc.__cause__, (ConnectionRefusedError, FileNotFoundError)):
                    raise
            await asyncio.sleep(0.01)
        self._qmp = qmp
        await qmp.execute("cont")

    async def _exited_early(self) -> None:
        assert self._proc is not None
        await self._proc.wait()
        gone = await self.exited()
        assert gone is not None
        raise gone

    async def save(self, path: str) -> None:
        raise HypervisorError("a fake VM cannot be saved (it has no guest memory)")

    async def _execute(self, command: str, arguments: dict | None = None) -> object:
        if self._qmp is None:
            raise (await self.exited()) or HypervisorError(
                f"VM of sandbox {self.spec.sandbox_id} is not running")
        try:
            return await self._qmp.execute(command, arguments)
        except ExecuteError:
            raise  # refused: the caller says what was
        except GONE as exc:
            raise (await self.exited(grace=2)) or HypervisorError(
                f"QMP {command} to the fake VM of sandbox {self.spec.sandbox_id} failed: "
                f"{type(exc).__name__}: {exc}") from None

    async def threads(self) -> dict[ThreadRole, list[int]]:
        try:
            return await query.threads(self._execute, self.pid)
        except psutil.NoSuchProcess:
            raise (await self.exited(grace=2)) or HypervisorError("the fake VM is gone") \
                from None

    async def size(self) -> tuple[int, int]:
        return await query.size(self._execute)

    async def add_vcpus(self, count: int) -> list[int]:
        return await hotplug.add_vcpus(self._execute, count)

    async def add_memory(self, mib: int) -> int:
        return await hotplug.add_memory(self._execute, mib, self.spec.max_memory_mib)

    async def oom(self, container_id: str) -> None:
        """The guest's OOM killer struck `container_id` (the agent's GetOOMEvent says so):
        for tests, which reach the VM object only in-process."""
        await self._execute("x-fake-oom", {"container": container_id})

    async def stop(self, timeout: float = 10) -> None:
        proc = self._proc
        if proc is not None and proc.returncode is None and timeout > 0 and self._qmp:
            try:
                await asyncio.wait_for(self._qmp.execute("quit"), timeout)
            except Exception:
                pass
        elif proc is not None and proc.returncode is None:
            try:
                os.kill(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        if self._qmp is not None:
            qmp, self._qmp = self._qmp, None
            try:
                await qmp.disconnect()
            except Exception:
                pass
        if self._agent_stream is not None:  # never taken
            self._agent_stream[1].close()
            self._agent_stream = None
        if proc is not None:
            await end_child(proc, timeout, "fake VM")
            if self._log is not None:
                self._log.drain()
        try:
            os.unlink(self.control_socket)
        except FileNotFoundError:
            pass

    def kill(self) -> None:
        if self._proc is not None and self._proc.returncode is None:
            try:
                self._proc.kill()
            except ProcessLookupError:
                pass

    async def unasked_stop(self) -> str:
        """QEMU's own watch (shim/vm/qemu/monitor.py) on the fake's QMP: a test's client
        that stops the fake guest makes it say STOP, as QEMU would."""
        await self._execute("query-status")
        assert self._qmp is not None
        return await self._run.unasked_stop(self._qmp, self._execute)

    def console_tail(self, size: int = 2000) -> str:
        return tail(os.path.join(self.spec.workdir, LOG), size) or "(nothing)"

    async def wait(self) -> int:
        if self._proc is None:
            raise HypervisorError("VM was never launched")
        return await self._proc.wait()

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
        if self._log is not None:
            self._log.drain()
        how = (f"was killed by signal {signal.Signals(-status).name}" if status < 0
               else f"exited with status {status}")
        when = "while the pod was running" if self._booted else "before the guest came up"
        return VMExited(f"the fake VM (pid {proc.pid}) of sandbox {self.spec.sandbox_id} "
                        f"{how} {when}; it said: {self.console_tail(600)}")

    def dead(self) -> bool:
        return self._proc is not None and ended(self._proc)
