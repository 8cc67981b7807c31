"""QEMU driver: a pod's VM started (booted, or restored from a template's state) with
the command line of shim/vm/qemu_command.py, confined (jail.py), controlled over
QMP (thread ids, hot-plug, save), and how it ended said in QEMU's and the guest's words."""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
from typing import Callable

import psutil
from qemu.qmp import ConnectError, ExecuteError, QMPClient, QMPError

from ..config import DEFAULT_PATH as DEFAULT_CONFIG
from ..host.libc import last_errno, libc
from ..resources.update import MEMORY_BLOCK_MIB
from . import jail, qemu_command, stateload
from .hypervisor import (BootTimeout, CannotGrow, HypervisorError, MissingFile, RestoreFailed,
                         ThreadRole, VM, VMExited, VMSpec)
from .console import ConsoleLog
from .qemu_command import QBOOT, template_mac

# What a QMP call or the agent's first connection raises when QEMU dies under it.
VANISHED = (QMPError, OSError, EOFError, asyncio.IncompleteReadError)

log = logging.getLogger("podvm.qemu")

LOADING = "QEMU was loading the template's state"
# Both ends of a save: the root image's memory (mapped shared, from a file every VM maps)
# is not part of the state.
SAVE_CAPS = [{"capability": "x-ignore-shared", "state": True}]

PR_SET_THP_DISABLE = 41


def _no_huge_pages() -> None:
    """In QEMU's child before exec (inherited across it): no transparent huge pages.
    QEMU asks for them on guest RAM and the TCG cache; with them a guest page touched
    keeps 2 MiB resident, and what free page reporting returns is split off later.
    Measured: the idle guest's RAM 96.0 -> 91.3 MiB resident, boot no slower."""
    if libc().prctl(PR_SET_THP_DISABLE, 1, 0, 0, 0):
        raise OSError(last_errno(), "prctl(PR_SET_THP_DISABLE)")


class QemuVM(VM):
    def __init__(self, spec: VMSpec) -> None:
        self.spec = spec
        self._proc: asyncio.subprocess.Process | None = None
        self._qmp: QMPClient | None = None
        self._exit_status: int | None = None
        self._agent_stream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        self._booted = False
        self._boot_stage = "QEMU starting"  # where launch() is: said when it times out
        self._restore_from = ""
        self._console: ConsoleLog | None = None
        self._preexec: Callable[[], None] | None = None

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise HypervisorError(f"VM of sandbox {self.spec.sandbox_id} was never launched")
        return self._proc.pid

    @property
    def agent_socket(self) -> str:
        return qemu_command.agent_socket(self.spec.workdir)

    def take_agent_stream(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self._agent_stream is None:
            raise HypervisorError(f"VM of sandbox {self.spec.sandbox_id} is not running")
        stream, self._agent_stream = self._agent_stream, None
        return stream

    @property
    def qmp_socket(self) -> str:
        return qemu_command.qmp_socket(self.spec.workdir)

    @property
    def console_log(self) -> str:
        return qemu_command.console_log(self.spec.workdir)

    @property
    def console_socket(self) -> str:
        """QEMU's end of the guest's serial console, copied into console_log at a bounded
        size (shim/vm/console.py)."""
        return qemu_command.console_socket(self.spec.workdir)

    def command(self) -> list[str]:
        return qemu_command.command(self.spec)

    def check_files(self) -> None:
        q = self.spec.hypervisor
        where = self.spec.config_source
        if not os.path.isabs(where):
            where = DEFAULT_CONFIG
        for key, path, fix in (("path", q.path, "install the qemu-system-x86 package"),
                               ("kernel", q.kernel, "run `make install` (it builds them)"),
                               ("initrd", q.initrd, "run `make install` (it builds them)"),
                               ("image", q.image, "run `make install` (it builds them)")):
            if not os.path.isfile(path):
                raise MissingFile(f"{key} {path} does not exist: {fix}, or set "
                                  f"[hypervisor.qemu] {key} in {where}")
        if os.path.getsize(q.image) % (MEMORY_BLOCK_MIB << 20):
            raise MissingFile(f"image {q.image} is {os.path.getsize(q.image)} bytes, not a "
                              f"multiple of {MEMORY_BLOCK_MIB} MiB (a guest memory block): "
                              f"build it with guest/build.py")
        if not os.path.isfile(QBOOT):
            raise MissingFile(f"{QBOOT} (qboot firmware) does not exist: install the "
                              f"qemu-system-x86 package")

    async def launch(self, preexec=None, restore_from: str = "") -> None:
        """`restore_from`: a template's saved state (shim/vm/template.py) that
        QEMU loads instead of booting the guest; RestoreFailed when that fails."""
        self.check_files()
        os.makedirs(self.spec.workdir, mode=0o700, exist_ok=True)
        for path in (self.agent_socket, self.qmp_socket):
            _unlink(path)
        self._restore_from, self._preexec = restore_from, preexec
        cmd = self.command() + (["-incoming", "defer"] if restore_from else [])
        log.info("starting QEMU: %s", " ".join(cmd))
        libc()  # loaded before the fork: the child only calls it
        confine = jail.plan(self.spec) if self.spec.hypervisor.enable_jail else None
        if confine is not None:
            os.makedirs(confine.root, mode=0o700, exist_ok=True)

        def child() -> None:
            _no_huge_pages()
            if preexec is not None:
                preexec()  # first: it writes cgroup files the jail hides
            if confine is not None:
                jail.enter_or_say(confine)

        stderr = open(os.path.join(self.spec.workdir, "qemu.log"), "ab")
        try:
            self._proc = await asyncio.create_subprocess_exec(
                *cmd, stdin=asyncio.subprocess.DEVNULL, stdout=stderr, stderr=stderr,
                start_new_session=True, preexec_fn=child,
                pass_fds=[fd for nic in self.spec.nics for fd in nic.fds])
        except OSError as exc:
            raise HypervisorError(f"cannot run {cmd[0]}: {exc.strerror}") from None
        except subprocess.SubprocessError:  # what the child said is in qemu.log
            raise HypervisorError(f"cannot start QEMU of sandbox {self.spec.sandbox_id}: "
                                  f"{self._qemu_log_tail()}") from None
        finally:
            stderr.close()
        try:
            await self._guest_up()
        except HypervisorError as exc:  # QEMU is stopped
            # QEMU refusing the state ends it with status 1; a kill, a timeout, a crash is
            # not the template's fault and fails the pod as it would a boot.
            refused = self._proc.returncode is not None and self._proc.returncode > 0
            if restore_from and self._boot_stage == LOADING and refused:
                raise RestoreFailed(f"the template {restore_from} did not restore: {exc}") \
                    from None
            raise

    async def _guest_up(self) -> None:
        """Until the agent's port is open; QEMU stopped and the error said as the user
        needs it when it does not get there."""
        try:
            async with asyncio.timeout(self.spec.hypervisor.boot_timeout):
                await self._first_of(self._attach_and_boot(), self._exited_early())
        except TimeoutError:
            where = await self._vcpu_positions() if self._qmp is not None else ""
            await self.stop(timeout=0)
            raise BootTimeout(self._boot_timeout_message() + where) from None
        except VANISHED as exc:
            # QEMU died under the QMP handshake (an abort at start reads as EOF there):
            # its exit, not the broken socket, is what the user needs to hear about.
            gone = await self.exited(grace=2)
            await self.stop(timeout=0)
            if gone is not None:
                raise gone from None
            raise HypervisorError(f"cannot attach to QEMU of sandbox {self.spec.sandbox_id}: "
                                  f"{type(exc).__name__}: {exc}; QEMU said: "
                                  f"{self._qemu_log_tail()}; {self._accel_hint()}") from None
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
        status = proc.returncode if proc.returncode is not None else _peek_exit(proc.pid)
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
        how = (f"was killed by signal {signal.Signals(-status).name}" if status < 0
               else f"exited with status {status}")
        when = "while the pod was running" if self._booted else "before the guest came up"
        return VMExited(f"QEMU (pid {proc.pid}) of sandbox {self.spec.sandbox_id} {how} "
                        f"{when}; QEMU said: {self._qemu_log_tail()}; guest console ends "
                        f"with: {_tail(self.console_log) or '(nothing)'}; "
                        f"{self._accel_hint()}")

    def _accel_hint(self) -> str:
        q = self.spec.hypervisor
        where = self.spec.config_source or DEFAULT_CONFIG
        hint = f"[hypervisor.qemu] accel = \"{q.accel}\" in {where}"
        if q.accel == "kvm":
            hint += ("; if KVM cannot run guests on this host (nested virtualization), "
                     "set accel = \"tcg\" there")
        return hint

    async def _attach_and_boot(self) -> None:
        qmp = QMPClient(f"podvm-{self.spec.sandbox_id}")
        self._boot_stage = "QEMU had not opened its QMP socket"
        while True:  # the socket file appears a moment before QEMU listens on it
            if os.path.exists(self.qmp_socket):
                self._boot_stage = "QEMU had not answered the QMP handshake"
                try:
                    await qmp.connect(self.qmp_socket)
                    break
                except ConnectError as exc:
                    if not isinstance(exc.__cause__, ConnectionRefusedError):
                        raise
                    log.debug("QMP not listening yet: %s", exc)
            await asyncio.sleep(0.005)
        self._qmp = qmp
        # Before the guest runs, or restores: QEMU drops console output nobody reads.
        self._boot_stage = "the console socket of QEMU did not accept"
        self._console = await ConsoleLog.attach(
            self.console_socket, self.console_log,
            self.spec.hypervisor.console_log_max_kib << 10)
        # Connected before the guest runs: a guest that opens its port while the host
        # side is unconnected reads end-of-file.
        self._boot_stage = "the agent socket of QEMU did not accept"
        self._agent_stream = await asyncio.open_unix_connection(self.agent_socket)
        if self._restore_from:
            # The guest's port is open in the state loaded: nothing to wait for after cont.
            self._boot_stage = LOADING
            await self._load(self._restore_from)
            self._boot_stage = "QEMU did not start the vCPUs (QMP cont)"
            await qmp.execute("cont")
            log.info("guest agent port open (restored from %s)", self._restore_from)
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

    async def _load(self, path: str) -> None:
        """The saved state in `path`, through a pipe from a dd the shim runs
        (shim/vm/stateload.py)."""
        assert self._qmp is not None
        await self._qmp.execute("migrate-set-capabilities", {"capabilities": SAVE_CAPS})

        async def send(fd: int) -> None:
            assert self._qmp is not None
            self._qmp.send_fd_scm(fd)
            await self._qmp.execute("getfd", {"fdname": stateload.FD_NAME})
            await self._qmp.execute("migrate-incoming", {"uri": f"fd:{stateload.FD_NAME}"})

        await stateload.load(path, send, lambda: self._migration_done("loading"),
                             self._preexec)

    async def save(self, path: str) -> None:
        """Stop the guest and write its state to `path` (created; QEMU's migration stream,
        without the root image: it is mapped shared, and every VM maps the same file). The
        file's pages are dropped from the host's page cache once it is on disk."""
        await self._execute("stop")
        await self._execute("migrate-set-capabilities", {"capabilities": SAVE_CAPS})
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            assert self._qmp is not None
            self._qmp.send_fd_scm(fd)
            await self._execute("getfd", {"fdname": "template"})
            try:
                await self._execute("migrate", {"uri": "fd:template"})
            except ExecuteError as exc:
                raise HypervisorError(f"QEMU refused to save the VM: {exc}") from None
            await self._migration_done("saving")
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)

    async def _migration_done(self, doing: str) -> None:
        while True:
            state = await self._execute("query-migrate")
            status = state.get("status")  # type: ignore[union-attr]
            if status == "completed":
                return
            if status in ("failed", "cancelled"):
                raise (RestoreFailed if doing == "loading" else HypervisorError)(
                    f"QEMU failed {doing} the VM's state: "
                    f"{state.get('error-desc', status)}")  # type: ignore[union-attr]
            await asyncio.sleep(0.005)

    def _boot_timeout_message(self) -> str:
        q = self.spec.hypervisor
        return (f"the guest of sandbox {self.spec.sandbox_id} did not come up within "
                f"{q.boot_timeout}s (accel={q.accel}): {self._boot_stage}; QEMU said: "
                f"{self._qemu_log_tail()}; "
                f"guest console ends with: {_tail(self.console_log) or '(nothing)'}; "
                f"{self._accel_hint()}")

    async def _vcpu_positions(self) -> str:
        """Where the instruction pointer of each vCPU in 64-bit mode is ("; vCPU
        instruction pointers: 0x..."), for a guest that hangs in its kernel without a word
        on the console (`quiet`): the PVH-booted vmlinux is never relocated (KASLR is the
        bzImage decompressor's, which PVH skips; tests/vm/test_guest_hardening.py
        checks it), so its System.map names the function. A relocated kernel would need
        its offset from the guest's /proc/kallsyms. "" when QEMU cannot say."""
        try:
            text = await asyncio.wait_for(self._qmp.execute(  # type: ignore[union-attr]
                "human-monitor-command", {"command-line": "info registers -a"}), 2)
        except Exception as exc:  # a QEMU that does not answer is already in the message
            log.debug("info registers: %s", exc)
            return ""
        rips = [word.split("=", 1)[1].lstrip("0") or "0" for word in str(text).split()
                if word.startswith("RIP=")]
        return f"; vCPU instruction pointers: {', '.join('0x' + r for r in rips)}" if rips else ""

    def console_tail(self, size: int = 2000) -> str:
        return _tail(self.console_log, size) or "(nothing)"

    def _qemu_log_tail(self) -> str:
        return _tail(os.path.join(self.spec.workdir, "qemu.log")) or "(no output)"

    async def threads(self) -> dict[ThreadRole, list[int]]:
        cpus = await self._execute("query-cpus-fast")
        iothreads = await self._execute("query-iothreads")
        roles: dict[ThreadRole, list[int]] = {  # vCPUs in vCPU index order
            ThreadRole.VCPU: [c["thread-id"] for c in sorted(  # type: ignore[index]
                cpus, key=lambda c: c["cpu-index"])],  # type: ignore[index]
            ThreadRole.IOTHREAD: [t["thread-id"] for t in iothreads],  # type: ignore[index]
            ThreadRole.MAIN: [self.pid],
        }
        known = {tid for tids in roles.values() for tid in tids}
        try:
            tasks = [t.id for t in psutil.Process(self.pid).threads()]
        except psutil.NoSuchProcess:
            raise (await self.exited(grace=2)) or HypervisorError("QEMU is gone") from None
        roles[ThreadRole.OTHER] = sorted(t for t in tasks if t not in known)
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
        """vCPUs present and memory (MiB, boot + DIMMs) as QEMU reports them now; the
        root image's virtio-pmem is plugged memory to QEMU, not RAM."""
        cpus = await self._execute("query-cpus-fast")
        memory = await self._execute("query-memory-size-summary")
        devices = await self._execute("query-memory-devices")
        dimms = sum(d["data"]["size"] for d in devices  # type: ignore[union-attr,index]
                    if d["type"] == "dimm")  # type: ignore[index]
        return len(cpus), (memory["base-memory"] + dimms) >> 20  # type: ignore[index]

    async def add_vcpus(self, count: int) -> list[int]:
        """Hot-plug `count` vCPUs into free slots (ACPI CPU hot-plug; the guest onlines
        them); their host thread ids. There is no unplug: after a device_del of a vCPU,
        QEMU 7.2 under TCG crashes (double free) on its next device_add, so a VM shrinks
        by taking vCPUs offline in the guest instead (their threads then sleep). Under
        TCG there is no free slot: every vCPU is plugged at boot (see command())."""
        slots = await self._execute("query-hotpluggable-cpus")
        free = sorted((s for s in slots if "qom-path" not in s),  # type: ignore[union-attr]
                      key=lambda s: tuple(sorted(s["props"].items())))
        if count > len(free):
            raise CannotGrow(f"cannot add {count} vCPUs: only {len(free)} of "
                             f"{len(slots)} slots are free (maxcpus)")  # type: ignore[arg-type]
        present = await self._execute("query-cpus-fast")
        before = {c["thread-id"] for c in present}  # type: ignore[union-attr]
        try:
            for slot in free[:count]:
                props = dict(slot["props"])
                device_id = "vcpu-" + "-".join(str(props[k]) for k in sorted(props))
                await self._execute("device_add", {"driver": slot["type"], "id": device_id,
                                                   **props})
        except ExecuteError as exc:
            raise CannotGrow(f"vCPU hot-plug refused by QEMU: {exc}") from None
        after = await self._execute("query-cpus-fast")
        return sorted(c["thread-id"] for c in after  # type: ignore[union-attr]
                      if c["thread-id"] not in before)

    async def add_memory(self, mib: int) -> int:
        """Hot-plug `mib` MiB as one pc-dimm (the guest onlines its blocks); MiB added.
        Memory is never taken back: a guest cannot be trusted to give it up."""
        if mib <= 0 or mib % MEMORY_BLOCK_MIB:
            raise CannotGrow(f"memory hot-plug takes multiples of {MEMORY_BLOCK_MIB} "
                             f"MiB, not {mib}")
        _, total = await self.size()
        if total + mib > self.spec.max_memory_mib:
            raise CannotGrow(f"cannot add {mib} MiB: the VM has {total} MiB and may "
                             f"grow to {self.spec.max_memory_mib} MiB (maxmem)")
        dimms = [d for d in await self._execute("query-memory-devices")]  # type: ignore[union-attr]
        name = f"mem{len(dimms)}"
        try:
            await self._execute("object-add", {"qom-type": "memory-backend-ram", "id": name,
                                               "size": mib << 20})
        except ExecuteError as exc:
            raise CannotGrow(f"memory hot-plug of {mib} MiB refused by QEMU: {exc}") from None
        try:
            await self._execute("device_add", {"driver": "pc-dimm",
                                               "id": f"dimm{len(dimms)}", "memdev": name})
        except ExecuteError as exc:
            await self._execute("object-del", {"id": name})
            raise CannotGrow(f"memory hot-plug of {mib} MiB refused by QEMU: {exc}") from None
        return mib

    async def stop(self, timeout: float = 10) -> None:
        proc = self._proc
        if proc is not None and proc.returncode is None and timeout > 0 and self._qmp:
            try:
                await asyncio.wait_for(self._qmp.execute("quit"), timeout)
            except Exception as exc:
                log.debug("QMP quit: %s", exc)
        await self._disconnect_qmp()
        if self._agent_stream is not None:  # never taken
            self._agent_stream[1].close()
            self._agent_stream = None
        if proc is not None and proc.returncode is None:
            try:
                await asyncio.wait_for(proc.wait(), timeout)
            except TimeoutError:
                pass
            if proc.returncode is None:
                log.warning("killing QEMU %d", proc.pid)
                try:
                    os.kill(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                await proc.wait()
        if self._console is not None:
            console, self._console = self._console, None
            await console.close()
        for path in (self.agent_socket, self.qmp_socket, self.console_socket):
            _unlink(path)

    async def _disconnect_qmp(self) -> None:
        if self._qmp is not None:
            qmp, self._qmp = self._qmp, None
            try:
                await qmp.disconnect()
            except Exception as exc:  # QEMU may already be gone
                log.debug("QMP disconnect: %s", exc)

    def dead(self) -> bool:
        proc = self._proc
        if proc is None:
            return False
        if proc.returncode is not None:
            return True
        try:
            return psutil.Process(proc.pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    async def wait(self) -> int:
        if self._proc is None:
            raise HypervisorError("VM was never launched")
        return await self._proc.wait()


def _peek_exit(pid: int) -> int | None:
    """How a child that has ended did (as Popen.returncode: -N for signal N), read
    without reaping it: asyncio's child watcher, which reaps it, may not have run yet
    on a busy machine. None while it runs or once it is reaped."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return None
    if info is None:
        return None
    if info.si_code == os.CLD_EXITED:
        return info.si_status
    return -info.si_status  # CLD_KILLED, CLD_DUMPED


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _tail(path: str, size: int = 600) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - size))
            return f.read().decode(errors="replace").strip().replace("\n", " | ")
    except OSError:
        return ""
