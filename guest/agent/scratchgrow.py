"""The pod's scratch disk grown to the pod's size (issue 44): every disk starts as one
blank file system (shim/vm/scratchdisk.py, the one a template's guest has seen), and once
the host has resized the virtio disk (QMP block_resize) the mounted ext4 is grown online
to fill it (EXT4_IOC_RESIZE_FS: the kernel adds block groups; the blank's reserved GDT
blocks, or meta_bg beyond them, make room for their descriptors)."""
from __future__ import annotations

import asyncio
import fcntl
import os
import struct
import time

from podvm_core.ttrpc import Code, TtrpcError

from . import writable

EXT4_IOC_RESIZE_FS = 0x40086610  # _IOW('f', 16, __u64)


def _device_bytes(device: str) -> int:
    with open(f"/sys/block/{os.path.basename(device)}/size") as f:
        return int(f.read()) * 512


async def grow(size_bytes: int, wait_seconds: float = 10.0) -> int:
    """The scratch file system's size in bytes once grown to `size_bytes`; waits for
    the disk to show that size (the host's resize reaches the guest as a config change
    the kernel handles on its own). Never shrinks."""
    writable.mount_scratch()
    device = writable.scratch_device()
    deadline = time.monotonic() + wait_seconds
    while (have := _device_bytes(device)) < size_bytes:
        if time.monotonic() > deadline:
            raise TtrpcError(Code.FAILED_PRECONDITION, f"the scratch disk {device} has "
                             f"{have} bytes, not the {size_bytes} the host resized it to")
        await asyncio.sleep(0.02)
    fd = os.open(writable.SCRATCH, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        block = os.fstatvfs(fd).f_frsize
        blocks = os.fstatvfs(fd).f_blocks
        if size_bytes // block > blocks:
            try:
                fcntl.ioctl(fd, EXT4_IOC_RESIZE_FS, struct.pack("Q", size_bytes // block))
            except OSError as exc:
                raise TtrpcError(Code.INTERNAL, f"growing the scratch file system to "
                                 f"{size_bytes} bytes: {exc}") from None
        return os.fstatvfs(fd).f_blocks * block
    finally:
        os.close(fd)
