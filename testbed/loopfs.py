"""A small ext4 of a known size on a loop device, for a bench or test that must see a host
file system fill up without filling the machine's own: podvm's `scratch_path` put on it
(the pods' scratch disks) and, beside it, the pods' log directories (where the shim links
each disk for kubelet, which needs the same file system: shim/host/podlogdisk.py)."""
from __future__ import annotations

import os
import pathlib
import subprocess

from .prereqs import require_tool

MIB = 1 << 20


class LoopFs:
    """`size_mib` of ext4 in the file `image`, mounted on `mountpoint` while in `with`;
    unmounted and the image removed afterwards (the loop device goes with the mount:
    `mount -o loop` sets autoclear). No blocks reserved for root (QEMU writes as a uid
    of its own) and no journal: its free space is close to its size, and each MiB a pod
    writes is a MiB it loses."""

    def __init__(self, image: pathlib.Path, mountpoint: pathlib.Path, size_mib: int) -> None:
        if size_mib < 16:
            raise ValueError(f"a loop file system of {size_mib} MiB: want 16 MiB or more")
        self.image, self.mountpoint, self.size_mib = image, mountpoint, size_mib

    def free_bytes(self) -> int:
        """What an unprivileged writer may still take (statvfs f_bavail)."""
        st = os.statvfs(self.mountpoint)
        return st.f_bavail * st.f_frsize

    def __enter__(self) -> "LoopFs":
        require_tool("mkfs.ext4", "e2fsprogs")
        with open(self.image, "xb") as f:
            f.truncate(self.size_mib * MIB)
        try:
            subprocess.run(["mkfs.ext4", "-q", "-m", "0", "-O", "^has_journal", "-N", "4096",
                            str(self.image)], check=True, capture_output=True, text=True)
            self.mountpoint.mkdir(exist_ok=True)
            subprocess.run(["mount", "-o", "loop", str(self.image), str(self.mountpoint)],
                           check=True, capture_output=True, text=True)
        except BaseException:
            self.image.unlink()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        done = subprocess.run(["umount", str(self.mountpoint)], capture_output=True,
                              text=True)
        if done.returncode != 0:
            raise RuntimeError(f"umount {self.mountpoint}: {done.stderr.strip()} (the loop "
                               f"file system and {self.image} are left: unmount it by hand)")
        self.image.unlink()
