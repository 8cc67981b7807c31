"""The uid and gid of one VM's jailed QEMU (shim/host/jailids.py hands them out), held by
its driver (shim/vm/qemu/driver.py) from launch to stop: what QEMU must open as that id is
given to it (its work directory, where it makes its sockets, pid file and log; the
descriptors of the guest's RAM and scratch disk, which it opens again by /proc/self/fd
paths; virtiofsd's socket, which it connects to), and the id goes back to the node once
no QEMU of the VM runs as it."""
from __future__ import annotations

import contextlib
import os

from ...host import jailids
from ..hypervisor import VMSpec


class JailId:
    def __init__(self, spec: VMSpec) -> None:
        self._owner = spec.workdir
        self._range = (spec.hypervisor.jail_id_first, spec.hypervisor.jail_id_count)
        self.number: int | None = None

    def claim(self) -> int:
        """Claimed (once), and the work directory made its."""
        if self.number is None:
            self.number = jailids.claim(self._owner, *self._range)
        os.chown(self._owner, self.number, self.number, follow_symlinks=False)
        return self.number

    def give(self, fd: int) -> None:
        if self.number is not None:
            os.fchown(fd, self.number, self.number)

    def give_socket(self, path: str) -> None:
        """A socket root made (virtiofsd's: its umask leaves others no write) given to
        QEMU. Called before the guest runs (QEMU has not started, or waits for `cont`),
        so no guest can have planted a link there; lchown would not follow one anyway."""
        if self.number is not None:
            os.chown(path, self.number, self.number, follow_symlinks=False)

    def release(self) -> None:
        """Once no QEMU of the VM runs: the id free, the work directory the node's."""
        if self.number is not None:
            jailids.release(self.number, self._owner)
            self.number = None
            with contextlib.suppress(FileNotFoundError):
                os.chown(self._owner, 0, 0, follow_symlinks=False)
