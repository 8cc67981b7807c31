"""What the user is told when a QEMU VM cannot be had: the files the configuration names
that are not there, and how a VM that did not come up or ended did, in QEMU's and the
guest's own words (their logs' last lines), with the setting to change."""
from __future__ import annotations

import asyncio
import logging
import os
import signal

from qemu.qmp import QMPClient

from ...config import DEFAULT_PATH as DEFAULT_CONFIG
from ...resources.update import MEMORY_BLOCK_MIB
from ..hypervisor import MissingFile, VMExited, VMSpec
from ..vmmlog import tail
from . import command
from .command import qboot

log = logging.getLogger("podvm.qemu")


def check_files(spec: VMSpec) -> None:
    """MissingFile, with the fix, for a file of `spec`'s VM that is not there or unfit."""
    q = spec.hypervisor
    where = spec.config_source
    if not os.path.isabs(where):
        where = DEFAULT_CONFIG
    files = [("path", q.path, "install the qemu-system-x86 package"),
             ("kernel", q.kernel, "run `make install` (it builds them)"),
             ("initrd", q.initrd, "run `make install` (it builds them)"),
             ("image", q.image, "run `make install` (it builds them)")]
    if q.shared_fs == "virtio-fs":
        files.append(("virtio_fs_daemon", q.virtio_fs_daemon,
                      "run `make install` or `podvm-node install` (podvm's own Rust "
                      "virtiofsd)"))
    for key, path, fix in files:
        if not os.path.isfile(path):
            raise MissingFile(f"{key} {path} does not exist: {fix}, or set "
                              f"[hypervisor.qemu] {key} in {where}")
    if os.path.getsize(q.image) % (MEMORY_BLOCK_MIB << 20):
        raise MissingFile(f"image {q.image} is {os.path.getsize(q.image)} bytes, not a "
                          f"multiple of {MEMORY_BLOCK_MIB} MiB (a guest memory block): "
                          f"build it with guest/build.py")
    firmware = qboot(q.path)
    if not os.path.isfile(firmware):
        raise MissingFile(f"{firmware} (qboot firmware) does not exist: install the "
                          f"qemu-system-x86 package")


def exited(spec: VMSpec, pid: int, status: int, booted: bool) -> VMExited:
    """How QEMU (`pid`, ended with Popen.returncode `status`) ended, and what it and the
    guest said last."""
    how = (f"was killed by signal {signal.Signals(-status).name}" if status < 0
           else f"exited with status {status}")
    when = "while the pod was running" if booted else "before the guest came up"
    return VMExited(f"QEMU (pid {pid}) of sandbox {spec.sandbox_id} {how} "
                    f"{when}; QEMU said: {qemu_log_tail(spec)}; guest console ends "
                    f"with: {tail(command.console_log(spec.workdir)) or '(nothing)'}; "
                    f"{accel_hint(spec)}")


def boot_timeout(spec: VMSpec, stage: str) -> str:
    """A guest that did not come up in time: where its boot was (`stage`)."""
    q = spec.hypervisor
    return (f"the guest of sandbox {spec.sandbox_id} did not come up within "
            f"{q.boot_timeout}s (accel={q.accel}): {stage}; QEMU said: "
            f"{qemu_log_tail(spec)}; "
            f"guest console ends with: "
            f"{tail(command.console_log(spec.workdir)) or '(nothing)'}; "
            f"{accel_hint(spec)}")


def accel_hint(spec: VMSpec) -> str:
    q = spec.hypervisor
    where = spec.config_source or DEFAULT_CONFIG
    hint = f"[hypervisor.qemu] accel = \"{q.accel}\" in {where}"
    if q.accel == "kvm":
        hint += ("; if KVM cannot run guests on this host (nested virtualization), "
                 "set accel = \"tcg\" there")
    return hint


async def vcpu_positions(qmp: QMPClient) -> str:
    """Where the instruction pointer of each vCPU in 64-bit mode is ("; vCPU
    instruction pointers: 0x..."), for a guest that hangs in its kernel without a word
    on the console (`quiet`): the PVH-booted vmlinux is never relocated (KASLR is the
    bzImage decompressor's, which PVH skips; tests/vm/test_guest_hardening.py
    checks it), so its System.map names the function. A relocated kernel would need
    its offset from the guest's /proc/kallsyms. "" when QEMU cannot say."""
    try:
        text = await asyncio.wait_for(qmp.execute(
            "human-monitor-command", {"command-line": "info registers -a"}), 2)
    except Exception as exc:  # a QEMU that does not answer is already in the message
        log.debug("info registers: %s", exc)
        return ""
    rips = [word.split("=", 1)[1].lstrip("0") or "0" for word in str(text).split()
            if word.startswith("RIP=")]
    return f"; vCPU instruction pointers: {', '.join('0x' + r for r in rips)}" if rips else ""


def qemu_log_tail(spec: VMSpec) -> str:
    return tail(os.path.join(spec.workdir, "qemu.log")) or "(no output)"
