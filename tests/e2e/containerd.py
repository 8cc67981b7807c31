"""A private containerd for tests and the demo: its own root, state and sockets, podvm
registered, stopped and cleaned up afterwards."""
from __future__ import annotations

import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

from . import image

SHIM_BIN_DIR = pathlib.Path(sys.executable).parent  # the venv with containerd-shim-podvm-v2


class Containerd:
    def __init__(self, workdir: pathlib.Path, namespace: str = "podvm-test") -> None:
        self.workdir = workdir
        self.namespace = namespace
        self.root = workdir / "root"
        self.state = workdir / "state"
        self.address = str(workdir / "containerd.sock")
        self.ttrpc_address = self.address + ".ttrpc"
        self.config = workdir / "config.toml"
        self.log_path = workdir / "containerd.log"
        self.process: subprocess.Popen | None = None

    def start(self, timeout: float = 30) -> "Containerd":
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config.write_text(f"""\
version = 2
root = "{self.root}"
state = "{self.state}"
disabled_plugins = ["io.containerd.grpc.v1.cri"]

[grpc]
  address = "{self.address}"

[ttrpc]
  address = "{self.ttrpc_address}"

[debug]
  level = "debug"
""")
        env = dict(os.environ, PATH=f"{SHIM_BIN_DIR}:{os.environ.get('PATH', '')}")
        self._log = open(self.log_path, "ab")
        self.process = subprocess.Popen(["containerd", "--config", str(self.config)],
                                        stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                        start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"containerd exited {self.process.returncode}:\n{self.log()}")
            if os.path.exists(self.address) and self.ctr("version", check=False).returncode == 0:
                return self
            time.sleep(0.1)
        raise RuntimeError(f"containerd did not come up in {timeout}s:\n{self.log()}")

    def ctr(self, *args: str, check: bool = True, timeout: float = 120,
            input: bytes | None = None) -> subprocess.CompletedProcess:
        result = subprocess.run(["ctr", "--address", self.address, "--namespace",
                                 self.namespace, *args], capture_output=True,
                                timeout=timeout, input=input)
        if check and result.returncode != 0:
            raise RuntimeError(f"ctr {' '.join(args)} exited {result.returncode}: "
                               f"{result.stderr.decode(errors='replace')}")
        return result

    def import_busybox(self, cache: pathlib.Path) -> str:
        archive = image.build_archive(cache / "busybox-oci.tar")
        self.ctr("images", "import", str(archive))
        return image.IMAGE_NAME

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if getattr(self, "_log", None):
            self._log.close()
        for mount in reversed(mounts_under(self.workdir)):
            subprocess.run(["umount", "-l", mount], check=False)
        shutil.rmtree(self.root, ignore_errors=True)
        shutil.rmtree(self.state, ignore_errors=True)

    def __enter__(self) -> "Containerd":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def mounts_under(path: pathlib.Path) -> list[str]:
    prefix = str(path)
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    return [p for p in points if p == prefix or p.startswith(prefix + "/")]


def podvm_shims() -> list[str]:
    """Command lines of every running podvm shim daemon."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmdline = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"containerd-shim-podvm-v2" in cmdline:
            found.append(cmdline.replace(b"\0", b" ").decode(errors="replace"))
    return found
