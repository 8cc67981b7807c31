"""The pod's sysctls, written in its namespaces: from inside the holder's ipc and uts
namespaces (busybox nsenter), so that kernel.shm*, fs.mqueue.* and kernel.domainname
are the pod's; net.* land in the guest's network namespace, which the pod's containers
share. The shim has already refused what would change the whole VM unless allowed."""
from __future__ import annotations

from typing import Mapping

from podvm_core.sysctl import proc_path
from podvm_core.ttrpc import Code, TtrpcError

from .reaper import run

BUSYBOX = "/bin/busybox"
# The value travels as an argument, never as shell text.
_WRITE = 'printf "%s\\n" "$2" > "$1"'


async def apply(holder_pid: int, sysctls: Mapping[str, str], what: str) -> None:
    """Write each sysctl as the holder `holder_pid` sees /proc/sys; the first that the
    guest kernel refuses ends it, named with the kernel's words."""
    for name, value in sorted(sysctls.items()):
        try:
            path = proc_path(name)
        except ValueError as exc:
            raise TtrpcError(Code.INVALID_ARGUMENT, f"{what}: {exc}") from None
        status, _, stderr = await run([BUSYBOX, "nsenter", "-t", str(holder_pid), "-i", "-u",
                                       "--", BUSYBOX, "sh", "-c", _WRITE, "sh", path, value])
        if status != 0:
            said = stderr.decode(errors="replace").strip()
            raise TtrpcError(Code.INVALID_ARGUMENT,
                             f"{what}: sysctl {name}={value} cannot be set in the guest: {said}")
