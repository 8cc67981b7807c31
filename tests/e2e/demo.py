"""`make demo`: podvm on a private containerd, end to end as far as podvm goes today.

Starts a containerd of its own (own root, state and sockets; the system's containerd is
not touched), registers podvm, imports a locally built busybox image, runs a container
with `ctr run --runtime io.containerd.podvm.v2`, shows what containerd and the shim said,
and removes everything it made.
"""
from __future__ import annotations

import pathlib
import sys
import tempfile

from shim import paths

from .containerd import Containerd, mounts_under, podvm_shims


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="podvm-demo-") as tmp:
        workdir = pathlib.Path(tmp)
        print(f"== private containerd in {workdir}")
        with Containerd(workdir / "containerd", namespace="podvm-demo") as ctd:
            image = ctd.import_busybox(workdir)
            print(f"== image {image} imported (busybox-static, built locally)")
            cmd = ["run", "--rm", "--runtime", "io.containerd.podvm.v2", image, "demo-1",
                   "uname", "-a"]
            print("== ctr " + " ".join(cmd))
            result = ctd.ctr(*cmd, check=False)
            sys.stdout.write(result.stdout.decode())
            sys.stdout.write(result.stderr.decode())
            print("== what the podvm shim logged (containerd's log, through the log FIFO):")
            for line in ctd.log().splitlines():
                if "runtime=io.containerd.podvm.v2" in line or "shim disconnected" in line:
                    print("   " + line)
            sock = paths.socket_path(paths.socket_address(ctd.address, ctd.namespace,
                                                          "demo-1"))
            left = [s for s in podvm_shims() if ctd.address in s]
        left += [m for m in mounts_under(workdir)]
        left += [sock] if pathlib.Path(sock).exists() else []
        print("== left behind: " + (", ".join(left) if left else "nothing"))
    print("podvm answers containerd over ttrpc today; running the container inside a VM "
          "comes with the VM backend (QEMU driver and guest agent).")
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
