"""A seccomp filter of podvm's own, installed in QEMU's child before exec (after
no_new_privs, under QEMU's own `-sandbox` filter, which stacks on it): QEMU reaches no
process but itself. QEMU runs as uid 0 with the same capabilities in every pod, and
Linux lets a process ptrace or signal another of the same uid whose capabilities are a
subset of its own: without this, a QEMU taken over by its guest could attach to another
pod's QEMU (its guest's memory, its descriptors) or kill the shims and containerd. QEMU's
`-sandbox` groups deny none of these calls.

Refused with EPERM: ptrace, process_vm_readv/writev, kcmp, tkill, the pidfd calls; kill,
tgkill, rt_sigqueueinfo and rt_tgsigqueueinfo unless their target is QEMU's own pid
(glibc's raise and pthread_kill name it); any call of another ABI than x86-64's."""
from __future__ import annotations

import ctypes
import errno
import os

from ..host.libc import last_errno, libc

PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
AUDIT_ARCH_X86_64 = 0xC000003E
X32_SYSCALL_BIT = 0x40000000
RET_ALLOW = 0x7FFF0000
RET_EPERM = 0x00050000 | errno.EPERM
LD_ABS, JEQ, JGE, RET = 0x20, 0x15, 0x35, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, ..|JGE|K, BPF_RET|K

REFUSED = {"ptrace": 101, "tkill": 200, "process_vm_readv": 310, "process_vm_writev": 311,
           "kcmp": 312, "pidfd_send_signal": 424, "pidfd_open": 434, "pidfd_getfd": 438}
OWN_PID_ONLY = {"kill": 62, "rt_sigqueueinfo": 129, "tgkill": 234, "rt_tgsigqueueinfo": 297}
"""x86-64 system call numbers (asm/unistd_64.h)."""


class _Insn(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8),
                ("k", ctypes.c_uint32)]


class _Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(_Insn))]


def program(pid: int) -> list[tuple[int, int, int, int]]:
    """The filter for the process `pid`, as (code, jt, jf, k). The jumps are forward,
    relative to the next instruction; three exits at the end: allow, check, refuse."""
    head = [(LD_ABS, 0, 0, 4), (JEQ, 1, 0, AUDIT_ARCH_X86_64), None,
            (LD_ABS, 0, 0, 0), None]
    tests = [(nr, "refuse") for nr in REFUSED.values()] + \
        [(nr, "check") for nr in OWN_PID_ONLY.values()]
    body_end = len(head) + len(tests)
    exits = {"allow": body_end, "check": body_end + 1, "refuse": body_end + 4}
    insns: list = head + [(JEQ, exits[where] - (len(head) + i) - 1, 0, nr)
                          for i, (nr, where) in enumerate(tests)]
    insns[2] = (RET, 0, 0, RET_EPERM)  # another ABI (i386's int 0x80)
    insns[4] = (JGE, exits["refuse"] - 5, 0, X32_SYSCALL_BIT)  # x32's numbers
    insns += [(RET, 0, 0, RET_ALLOW),
              (LD_ABS, 0, 0, 16),  # the first argument's low 32 bits: a pid_t
              (JEQ, 0, 1, pid & 0xFFFFFFFF),
              (RET, 0, 0, RET_ALLOW),
              (RET, 0, 0, RET_EPERM)]
    return insns


def install() -> None:
    """In QEMU's child, after PR_SET_NO_NEW_PRIVS: the filter for the pid QEMU keeps."""
    insns = program(os.getpid())
    array = (_Insn * len(insns))(*(_Insn(*i) for i in insns))
    prog = _Prog(len(insns), ctypes.cast(array, ctypes.POINTER(_Insn)))
    if libc().prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0):
        err = last_errno()
        raise OSError(err, f"QEMU's jail: seccomp filter: {os.strerror(err)}")
