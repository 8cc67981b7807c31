"""What the shim needs from a VMM: boot a sized VM (or restore a template's saved one),
say which host thread does what, grow it, save it, stop it, notice when it dies. The way
in for every caller: shim/vm/vmm.py's `create()` makes the VM a spec describes (QEMU's,
shim/vm/qemu/driver.py, the one implementation today); this module names no implementation.
Policy (sizes, placement) is decided elsewhere."""
from __future__ import annotations

import abc
import asyncio
import enum
from dataclasses import dataclass
from typing import Callable, Protocol

from ..config import HypervisorConfig
from ..network.model import PlaceholderNic, TapNic


class HypervisorError(Exception):
    """The VM could not be had or used: the message says what the VMM said and what to
    change. shim/api/errors.py gives each kind its one ttrpc code."""


class BootTimeout(HypervisorError):
    """The guest did not reach its agent in time (the VM was killed)."""


class VMExited(HypervisorError):
    """The VMM process is gone: it aborted at start, or was killed or crashed later."""


class VMKilled(VMExited):
    """The shim killed the VMM: its guest stopped answering, or the VMM stopped running
    it (shim/pod/pod.py, `Pod.kill_vm`); the message says which."""


class MissingFile(HypervisorError):
    """The VMM, kernel or initrd the configuration names is not there."""


class StaleGuest(MissingFile):
    """The guest image lacks a call this shim needs: it was built before the shim."""


class RestoreFailed(HypervisorError):
    """QEMU could not load a template's saved state (the VM was stopped)."""


class CannotGrow(HypervisorError):
    """The VM is running but refuses a hot-plug (no free slot, above maxmem)."""


class ThreadRole(str, enum.Enum):
    VCPU = "vcpu"
    MAIN = "main"
    IOTHREAD = "iothread"
    OTHER = "other"
    FILES = "files"
    """The threads of the process that serves the pod's files (virtiofsd)."""


@dataclass(frozen=True)
class VMSpec:
    """One VM, fully decided: the driver only turns it into a command line."""

    sandbox_id: str
    workdir: str
    """Private directory for the VM's sockets, console log and pid file."""
    shared_dir: str
    """Host directory exported to the guest (tag `podvm`, over virtio-fs or 9p as
    `hypervisor.shared_fs` says): container rootfs live here."""
    vcpus: int
    max_vcpus: int
    memory_mib: int
    max_memory_mib: int
    hypervisor: HypervisorConfig
    config_source: str = ""
    """Which configuration file set these, for error messages."""
    nics: tuple[TapNic | PlaceholderNic, ...] = ()
    """The pod's interfaces, bridged to taps whose descriptors QEMU inherits."""
    template: bool = False
    """The VM is a template (shim/vm/template/template.py) or is restored from one: its
    kernel line says so (the guest leaves its share to the agent's Resume) and its NICs
    have the template's MACs (template_mac)."""
    saved: bool = False
    """The VM boots to be saved as a template: nothing on it that cannot be saved (the
    virtio-fs device, which QEMU 7.2 cannot migrate, is added to those restored)."""
    memory_path: str = ""
    """The file that backs the guest's RAM (shared, so that virtiofsd can map it): a
    template's memory, or the restored copy of it; "" for a memfd of QEMU's own."""
    scratch_disk: str = ""
    """The file QEMU opens as the pod's scratch disk (shim/vm/scratchdisk.py): at
    launch, the descriptor of an unnamed copy of the blank file system; "" for none
    (scratch_disk_mib = 0, or a VM that is only planned)."""


def memory_file(state: str) -> str:
    """A saved VM is two files: its state (`state`, what save() wrote) and, beside it,
    the guest's memory, which the VM wrote itself while it ran."""
    return f"{state}.ram"


@dataclass(frozen=True)
class SavedVM:
    """A VM that save() wrote, and the digests its two files had then (SHA-256 per chunk,
    as shim/vm/stateload.py computes them): launch() loads neither unless it still has
    them. `memory_stamp`: the memory file's inode and change time once it was in place
    (memcopy.file_stamp; (0, 0): none): as long as the file has them, what the host's
    page cache holds of it is taken as checked."""
    state: str
    state_digests: tuple[str, ...]
    memory_digests: tuple[str, ...]
    memory_stamp: tuple[int, int] = (0, 0)

    @property
    def memory(self) -> str:
        return memory_file(self.state)


class MemoryAhead(Protocol):
    """A saved VM's memory being copied before its VM is launched (shim/vm/stateload.py
    MemoryCopy): launch() takes the descriptor and the copy under way."""
    saved: SavedVM

    def take(self) -> tuple[int, asyncio.Future[str]]: ...


def template_mac(index: int) -> str:
    """NIC `index`'s MAC in a template's VM and in those restored from it (locally
    administered, "pod" in its middle); the agent's Resume gives each NIC the pod's."""
    return f"02:70:6f:64:00:{index:02x}"


class VM(abc.ABC):
    """A booted guest whose agent answers on `agent_socket`."""

    spec: VMSpec

    @property
    @abc.abstractmethod
    def pid(self) -> int: ...

    @property
    @abc.abstractmethod
    def agent_socket(self) -> str: ...

    @property
    @abc.abstractmethod
    def control_socket(self) -> str:
        """The VMM's control socket: on its command line, so that `delete` after a crash
        finds the VMM by it (recorded before launch; shim/host/cleanup.py)."""

    @abc.abstractmethod
    def command(self) -> list[str]:
        """The VMM's command line (a template's key hashes it:
        shim/vm/template/template.py)."""

    @abc.abstractmethod
    def check_files(self) -> None:
        """MissingFile, saying what to install or configure, when a file the VM needs
        (VMM, kernel, initrd, image) is not there: checked before anything is made."""

    @abc.abstractmethod
    def take_agent_stream(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """The connection to the guest agent's port, made before the guest ran (once)."""

    @abc.abstractmethod
    async def launch(self, preexec: Callable[[], None] | None = None,
                     restore_from: SavedVM | None = None,
                     memory: MemoryAhead | None = None) -> None:
        """Start the VMM (running `preexec` in the child before exec: the sandbox cgroup
        enters there) and return once the guest agent's port is open; BootTimeout (VM
        killed) when the guest does not get there in time. `restore_from`: a saved VM
        (save()) loaded instead of booting the guest, into a VM whose spec has
        `template` set; RestoreFailed (VM stopped) when a file of it changed since it
        was saved, or the VMM refuses it. `memory`: the copy of `restore_from`'s memory,
        started by the caller (else launch starts it), the VM's from then on."""

    @abc.abstractmethod
    async def save(self, path: str) -> None:
        """Stop the guest and write its state to `path`, for launch(restore_from=)."""

    @abc.abstractmethod
    async def threads(self) -> dict[ThreadRole, list[int]]:
        """Every host thread of the VMM by role, read now (threads come and go), those of
        its helper processes (helper_pids) included."""

    @property
    def jail_id(self) -> int | None:
        """The uid and gid the VMM runs as, one of its own (shim/host/jailids.py); None
        where it is not jailed."""
        return None

    @property
    def helper_pids(self) -> list[int]:
        """Processes besides the VMM's own that serve this VM (virtiofsd), started with
        the same `preexec`."""
        return []

    @abc.abstractmethod
    async def stop(self, timeout: float = 10) -> None:
        """Ask the VMM to quit, kill it after `timeout`; a no-op when it is gone."""

    @abc.abstractmethod
    def kill(self) -> None:
        """SIGKILL to the VMM now, whatever state it is in (paused, stopped, hung): a
        guest that stopped answering is asked nothing more. stop() cleans up after."""

    @abc.abstractmethod
    async def unasked_stop(self) -> str:
        """Until the VMM stops running the guest without the shim asking (an I/O error
        policy, an operator, an internal error), or has done so already: the VMM's word
        for why. HypervisorError when the VMM is gone."""

    @abc.abstractmethod
    def console_tail(self, size: int = 2000) -> str:
        """The end of the guest's console, for error messages and logs."""

    @abc.abstractmethod
    async def wait(self) -> int:
        """Block until the VMM process exits; its exit status."""

    @abc.abstractmethod
    async def exited(self, grace: float = 0) -> VMExited | None:
        """The VMExited error that tells how the VMM ended (its own last words, the
        guest console), waiting up to `grace` seconds for an exit under way; None while
        it runs."""

    @abc.abstractmethod
    def dead(self) -> bool:
        """The VMM process has ended (a zombie counts), whether or not its exit has been
        collected yet: a stop requested now would not be what ended it."""

    @abc.abstractmethod
    async def size(self) -> tuple[int, int]:
        """vCPUs present and memory in MiB, as the VMM reports them now."""

    @abc.abstractmethod
    async def add_vcpus(self, count: int) -> list[int]:
        """Hot-plug `count` vCPUs; the host thread ids of the new ones."""

    @abc.abstractmethod
    async def add_memory(self, mib: int) -> int:
        """Hot-plug `mib` MiB of memory (never taken back); MiB added."""

    async def resize_scratch(self, size_bytes: int) -> None:
        """The scratch disk's device made `size_bytes` long (the guest is told)."""
        raise HypervisorError(f"the VM of sandbox {self.spec.sandbox_id} cannot resize its "
                              f"scratch disk")
