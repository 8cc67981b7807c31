"""A forked daemon's command line and environment as /proc shows them: those of the
`start` it serves, not the fork server's. Tools find a pod's shim by its command line
(`-id`, `-address`: testbed/containerd.py, shim/host/pids.py, an operator's `ps`), as
they find a daemon `start` forked itself.

prctl(PR_SET_MM, PR_SET_MM_MAP) points the kernel's argument and environment areas at
new buffers; it needs no capability when /proc/self/exe is kept (Linux 4.x and later,
built with CONFIG_CHECKPOINT_RESTORE, as Debian's is). The buffers live as long as the
process (module globals)."""
from __future__ import annotations

import ctypes
import os

from ..libc import last_errno

PR_SET_MM = 35
PR_SET_MM_MAP = 14
_KEEP_EXE = 0xFFFFFFFF


class _MmMap(ctypes.Structure):
    """struct prctl_mm_map (linux/prctl.h)."""
    _fields_ = [(name, ctypes.c_uint64) for name in (
        "start_code", "end_code", "start_data", "end_data", "start_brk", "brk",
        "start_stack", "arg_start", "arg_end", "env_start", "env_end", "auxv")] + [
        ("auxv_size", ctypes.c_uint32), ("exe_fd", ctypes.c_uint32)]


_kept: list[ctypes.Array] = []


class ProcTitleError(OSError):
    """The kernel refused the new command line: the message says why."""


def set_cmdline(cmdline: bytes, environ: bytes) -> None:
    """Make /proc/self/cmdline `cmdline` and /proc/self/environ `environ` (both as /proc
    has them: NUL-terminated strings, end to end)."""
    if not cmdline.endswith(b"\0") or (environ and not environ.endswith(b"\0")):
        raise ValueError("a command line and an environment end with a NUL")
    args = ctypes.create_string_buffer(cmdline, len(cmdline))
    env = ctypes.create_string_buffer(environ or b"\0", len(environ or b"\0"))
    with open("/proc/self/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()

    def field(number: int) -> int:  # proc(5)'s numbering, from 1
        return int(fields[number - 3])

    # a handle of its own: argtypes set on the shared one (shim/libc.py) would hold for
    # every caller, and pidfilter.py passes prctl a pointer
    c = ctypes.CDLL(None, use_errno=True)
    c.sbrk.restype = ctypes.c_void_p
    c.sbrk.argtypes = [ctypes.c_long]
    c.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong,
                        ctypes.c_ulong]
    mm = _MmMap(start_code=field(26), end_code=field(27), start_data=field(45),
                end_data=field(46), start_brk=field(47), brk=c.sbrk(0) or field(47),
                start_stack=field(28), arg_start=ctypes.addressof(args),
                arg_end=ctypes.addressof(args) + len(cmdline),
                env_start=ctypes.addressof(env), env_end=ctypes.addressof(env) + len(env),
                auxv=0, auxv_size=0, exe_fd=_KEEP_EXE)
    if c.prctl(PR_SET_MM, PR_SET_MM_MAP, ctypes.addressof(mm), ctypes.sizeof(mm), 0) != 0:
        err = last_errno()
        raise ProcTitleError(err, f"cannot set the daemon's command line: prctl(PR_SET_MM, "
                                  f"PR_SET_MM_MAP): {os.strerror(err)}")
    _kept[:] = [args, env]
