"""A seccomp filter of podvm's own, installed in QEMU's child before exec (after
no_new_privs, under QEMU's own `-sandbox` filter, which stacks on it): QEMU reaches no
process but itself, and none of the kernel's interfaces that act across processes or
that a denylist cannot follow. QEMU already runs as a uid of its own in IPC and network
namespaces of its own (shim/vm/qemu/jail.py), so the kernel's permission checks refuse these
calls on containerd, the shims and other pods' QEMUs; this filter is the second wall,
and the only one for what a uid does not stop. QEMU's `-sandbox` groups deny none of
them.

Refused with EPERM:
- ptrace, process_vm_readv/writev, kcmp, tkill, the pidfd calls; kill, tgkill,
  rt_sigqueueinfo and rt_tgsigqueueinfo unless their target is QEMU's own pid (glibc's
  raise and pthread_kill name it); prlimit64 unless on itself (pid 0 or its own);
- fcntl's F_SETSIG and F_SETOWN_EX, and F_SETOWN unless to itself: the SIGIO a
  descriptor sends is a signal to whoever it names, with a number of the caller's choice;
- perf_event_open (another process's events, the kernel's), io_uring (its own paths
  around seccomp: operations run by kernel workers that this filter never sees), bpf,
  keyctl, add_key and request_key (the keyrings a uid shares with the node's processes);
- any call of another ABI than x86-64's."""
from __future__ import annotations

import ctypes
import errno
import os

from ...libc import last_errno, libc

PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
AUDIT_ARCH_X86_64 = 0xC000003E
X32_SYSCALL_BIT = 0x40000000
RET_ALLOW = 0x7FFF0000
RET_EPERM = 0x00050000 | errno.EPERM
LD_ABS, JA, JEQ, JGE, RET = 0x20, 0x05, 0x15, 0x35, 0x06
"""BPF_LD|W|ABS, BPF_JMP|JA, BPF_JMP|JEQ|K, BPF_JMP|JGE|K, BPF_RET|K"""
NR, ARCH = 0, 4
"""Offsets in struct seccomp_data; an argument's low 32 bits are at arg(i)."""

REFUSED = {"ptrace": 101, "tkill": 200, "process_vm_readv": 310, "process_vm_writev": 311,
           "kcmp": 312, "pidfd_send_signal": 424, "pidfd_open": 434, "pidfd_getfd": 438,
           "perf_event_open": 298, "io_uring_setup": 425, "io_uring_enter": 426,
           "io_uring_register": 427, "bpf": 321, "keyctl": 250, "add_key": 248,
           "request_key": 249}
OWN_PID_ONLY = {"kill": 62, "rt_sigqueueinfo": 129, "tgkill": 234, "rt_tgsigqueueinfo": 297}
ITSELF = {"prlimit64": 302}
"""Allowed on pid 0 (the caller) or QEMU's own pid."""
FCNTL = 72
F_SETOWN, F_SETSIG, F_SETOWN_EX = 8, 10, 15
"""x86-64 system call numbers (asm/unistd_64.h), fcntl commands (asm-generic/fcntl.h)."""


def arg(index: int) -> int:
    return 16 + 8 * index


class _Insn(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8),
                ("k", ctypes.c_uint32)]


class _Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(_Insn))]


def program(pid: int) -> list[tuple[int, int, int, int]]:
    """The filter for the process `pid`, as (code, jt, jf, k): written with labels (a
    jump names where it goes, None: the next instruction; every jump goes forward, as
    BPF requires), resolved into offsets."""
    own = pid & 0xFFFFFFFF
    text: list[tuple] = [
        (LD_ABS, ARCH), (JEQ, AUDIT_ARCH_X86_64, None, "refuse"),  # i386's int 0x80
        (LD_ABS, NR), (JGE, X32_SYSCALL_BIT, "refuse", None),  # x32's numbers
        *((JEQ, nr, "refuse", None) for nr in REFUSED.values()),
        *((JEQ, nr, "own pid", None) for nr in OWN_PID_ONLY.values()),
        *((JEQ, nr, "itself", None) for nr in ITSELF.values()),
        (JEQ, FCNTL, "fcntl", None),
        (JA, "allow"),
        "own pid", (LD_ABS, arg(0)), (JEQ, own, "allow", "refuse"),
        "itself", (LD_ABS, arg(0)), (JEQ, 0, "allow", None), (JEQ, own, "allow", "refuse"),
        "fcntl", (LD_ABS, arg(1)), (JEQ, F_SETSIG, "refuse", None),
        (JEQ, F_SETOWN_EX, "refuse", None), (JEQ, F_SETOWN, None, "allow"),
        (LD_ABS, arg(2)), (JEQ, 0, "allow", None), (JEQ, own, "allow", "refuse"),
        "allow", (RET, RET_ALLOW),
        "refuse", (RET, RET_EPERM),
    ]
    labels, insns = {}, []
    for item in text:
        if isinstance(item, str):
            labels[item] = len(insns)
        else:
            insns.append(item)

    def offset(at: int, to: str | None) -> int:
        return 0 if to is None else labels[to] - at - 1  # BPF jumps only forward

    resolved = []
    for i, (code, *operands) in enumerate(insns):
        if code == JA:
            resolved.append((JA, 0, 0, offset(i, operands[0])))
        elif code in (JEQ, JGE):
            k, jt, jf = operands
            resolved.append((code, offset(i, jt), offset(i, jf), k))
        else:
            resolved.append((code, 0, 0, operands[0]))
    assert all(0 <= o <= 255 for _, jt, jf, _ in resolved for o in (jt, jf))
    return resolved


def install() -> None:
    """In QEMU's child, after PR_SET_NO_NEW_PRIVS: the filter for the pid QEMU keeps."""
    insns = program(os.getpid())
    array = (_Insn * len(insns))(*(_Insn(*i) for i in insns))
    prog = _Prog(len(insns), ctypes.cast(array, ctypes.POINTER(_Insn)))
    if libc().prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0):
        err = last_errno()
        raise OSError(err, f"QEMU's jail: seccomp filter: {os.strerror(err)}")
