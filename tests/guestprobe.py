"""Boot the guest image with a script of the test's own as init (a second cpio archive
the kernel unpacks over the image), no agent: what the guest kernel itself says."""
from __future__ import annotations

import os
import pathlib
import subprocess

import pytest

from guest.cpio import CpioWriter
from shim.hypervisor.qemu import KERNEL_PARAMS, QBOOT
from tests.conftest import require, require_tool
from tests.vmconfig import guest_image

INIT = "podvm-probe/init"


def run_probe(workdir: pathlib.Path, script: str, timeout: float = 240) -> str:
    """The guest console after `script` (run by the initramfs's busybox sh as PID 1, with
    /proc mounted; its output goes to the console) has run and the guest powered off."""
    require_tool("qemu-system-x86_64", "qemu-system-x86")
    require(os.path.isfile(QBOOT), f"{QBOOT} (Debian package qemu-system-data)")
    kernel, initrd = guest_image()
    overlay = workdir / "initrd.img"
    with open(overlay, "wb") as f:
        with open(initrd, "rb") as src:
            while chunk := src.read(1 << 20):
                f.write(chunk)
        cpio = CpioWriter(f)
        cpio.file(INIT, ("#!/bin/busybox sh\nexport PATH=/bin\nmount -t proc proc /proc\n"
                         f"{script}\npoweroff -f\n").encode(), 0o755)
        cpio.close()
    console = workdir / "console.log"
    argv = ["qemu-system-x86_64", "-machine", "q35", "-accel", "tcg", "-cpu", "max",
            "-bios", QBOOT, "-nodefaults", "-no-user-config", "-nographic", "-no-reboot",
            "-m", "256", "-kernel", kernel, "-initrd", str(overlay),
            "-append", f"{KERNEL_PARAMS} rdinit=/{INIT}", "-serial", f"file:{console}"]
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"the probe did not finish; console:\n{console.read_text()[-3000:]}")
    if proc.returncode != 0:
        pytest.fail(f"QEMU exited {proc.returncode}: {err.decode()[-500:]}")
    return console.read_text(errors="replace")
