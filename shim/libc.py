"""libc through ctypes, for the few system calls Python's os module lacks (mount,
umount2, setns, unshare, open_tree and move_mount through syscall, prctl): one handle,
loaded at the first call, so that neither the idle daemon nor a `start` that forks no
daemon pays for ctypes. A caller that forks a helper which must import nothing calls
`libc()` before the fork. Also what a helper's child sets up between fork and exec
(no_huge_pages, die_with_parent, descriptor_table)."""
from __future__ import annotations

import fcntl
import mmap
import os

_handle = None


def libc():
    global _handle
    if _handle is None:
        import ctypes  # at the first call, not with each module that names libc()

        handle = ctypes.CDLL(None, use_errno=True)
        handle.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p,
                                 ctypes.c_ulong, ctypes.c_char_p]
        handle.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
        handle.setns.argtypes = [ctypes.c_int, ctypes.c_int]
        handle.syscall.restype = ctypes.c_long
        _handle = handle
    return _handle


def last_errno() -> int:
    """errno as the last call through `libc()` left it."""
    import ctypes  # loaded by libc() already

    return ctypes.get_errno()


PR_SET_THP_DISABLE = 41


def no_huge_pages() -> None:
    """No transparent huge pages for this process, inherited across fork and exec (run
    in QEMU's child: QEMU asks for them on guest RAM and the TCG cache; with them a guest
    page touched keeps 2 MiB resident, and what free page reporting returns is split off
    later. Measured: the idle guest's RAM 96.0 -> 91.3 MiB resident, boot no slower)."""
    if libc().prctl(PR_SET_THP_DISABLE, 1, 0, 0, 0):
        raise OSError(last_errno(), "prctl(PR_SET_THP_DISABLE)")


DESCRIPTORS = 256


def descriptor_table(size: int = DESCRIPTORS) -> None:
    """Room for `size` descriptors in this process's table, made while it has one thread
    (in a child between fork and exec: exec keeps the table). The kernel grows the table
    of a process with threads only after an RCU grace period (expand_fdtable), 10-17 ms
    on the development machine, and QEMU has threads from its first instruction: it
    passed 64 descriptors as it started a restored VM's vCPUs (`cont`, on every restored
    pod's way to ready), and holds about 106 with a container running."""
    try:
        os.close(fcntl.fcntl(0, fcntl.F_DUPFD, size - 1))  # the lowest free from size - 1
    except OSError:  # a descriptor limit under `size`: the table grows as it must
        pass


PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """SIGKILL this process when the thread that started it ends (prctl PR_SET_PDEATHSIG):
    a helper whose work means nothing without its parent is never left running after it
    (a network worker of a daemon its `delete` killed, which would otherwise still use
    the install tree when the last collector of an uninstalled tree looks)."""
    if libc().prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0):
        raise OSError(last_errno(), "prctl(PR_SET_PDEATHSIG)")


def page_cached(fd: int, size: int) -> bytes:
    """Which pages of the file `fd`'s first `size` bytes are in the host's page cache
    (mincore(2) over a shared read-only mapping of them, which touches none): one byte a
    page, its lowest bit set where the page is cached."""
    import ctypes  # loaded by libc() already, as in last_errno

    if size <= 0:
        return b""
    lib = libc()
    lib.mmap.restype = ctypes.c_void_p
    lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                         ctypes.c_int, ctypes.c_long]
    lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    address = lib.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if address in (None, ctypes.c_void_p(-1).value):
        raise OSError(last_errno(), "mmap")
    try:
        pages = ctypes.create_string_buffer(-(-size // mmap.PAGESIZE))
        if lib.mincore(address, size, pages):
            raise OSError(last_errno(), "mincore")
        return pages.raw
    finally:
        lib.munmap(address, size)
