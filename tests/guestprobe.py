"""Boot the guest image with a script of the test's own as init (a second cpio archive
the kernel unpacks over the initramfs), no agent: what the guest kernel itself says.
With `root`, the script runs chrooted in the guest's root image (python3, runc, the
modules), mounted as the initramfs mounts it for a pod."""
from __future__ import annotations

import os
import pathlib
import subprocess

import pytest

from guest.cpio import CpioWriter
from shim.vm.qemu.command import KERNEL_PARAMS, QBOOT
from testbed.prereqs import require, require_tool
from testbed.vmconfig import guest_image, root_image

DIR = "podvm-probe"
# The initramfs's own steps to the root image (guest/initramfs-init), then the script as
# its PID 1 (the kernel's own helpers, such as modprobe, run there too), with
# /tmp/podvm-probe holding the test's files.
INTO_ROOT = f"""mount -t devtmpfs devtmpfs /dev
read -r modules < /etc/podvm-modules
modprobe -a $modules
tries=0
until [ -b /dev/pmem0 ] || [ $tries -ge 1000 ]; do usleep 10000; tries=$((tries + 1)); done
mount -t erofs -o ro /dev/pmem0 /root || echo "PROBE cannot mount the root image"
mount -t tmpfs -o mode=1777 tmpfs /root/tmp
cp -r /{DIR} /root/tmp/
mount -t proc proc /root/proc
mount -t sysfs sysfs /root/sys
mount --move /dev /root/dev
umount /proc
exec switch_root /root /bin/sh -c "sh /tmp/{DIR}/script; poweroff -f"
"""


def run_probe(workdir: pathlib.Path, script: str, timeout: float = 240, *,
              root: bool = False, files: dict[str, bytes] | None = None,
              memory_mib: int = 256, vcpus: int = 1, params: str = KERNEL_PARAMS) -> str:
    """The guest console after `script` (run by busybox sh as PID 1 with /proc mounted,
    or with `root` in the root image; its output goes to the console) has run and the
    guest powered off. `files`: put beside it, in /podvm-probe (/tmp/podvm-probe in the
    root image). `params`: the kernel command line (before rdinit=)."""
    require_tool("qemu-system-x86_64", "qemu-system-x86")
    require(os.path.isfile(QBOOT), f"{QBOOT} (Debian package qemu-system-data)")
    kernel, initrd = guest_image()
    overlay = workdir / "initrd.img"
    with open(overlay, "wb") as f:
        with open(initrd, "rb") as src:
            while chunk := src.read(1 << 20):
                f.write(chunk)
        cpio = CpioWriter(f)
        for name, data in (files or {}).items():
            cpio.file(f"{DIR}/{name}", data)
        cpio.file(f"{DIR}/script", (script + "\n").encode(), 0o755)
        cpio.file(f"{DIR}/init", ("#!/bin/busybox sh\nexport PATH=/bin\n" + (
            INTO_ROOT if root else
            f"mount -t proc proc /proc\nsh /{DIR}/script\npoweroff -f\n")).encode(), 0o755)
        cpio.close()
    console = workdir / "console.log"
    memory = [f"{memory_mib}M"]
    devices: list[str] = []
    if root:
        image = root_image()
        size = os.path.getsize(image)
        memory += ["slots=1", f"maxmem={memory_mib + (size >> 20)}M"]
        devices = ["-object", f"memory-backend-file,id=root,mem-path={image},size={size},"
                              f"share=on,readonly=on",
                   "-device", "virtio-pmem-pci,memdev=root"]
    argv = ["qemu-system-x86_64", "-machine", "q35", "-accel", "tcg,thread=multi,tb-size=64",
            "-cpu", "max", "-bios", QBOOT, "-nodefaults", "-no-user-config", "-nographic",
            "-no-reboot", "-m", ",".join(memory), "-smp", str(vcpus), *devices,
            "-kernel", kernel, "-initrd", str(overlay),
            "-append", f"{params} rdinit=/{DIR}/init", "-serial", f"file:{console}"]
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
