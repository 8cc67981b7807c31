"""A private containerd for tests and the demo: its own root, state and sockets, podvm
registered, stopped and cleaned up afterwards.

With `cri=True` it also serves the CRI (what kubelet and crictl speak) with two runtimes:
`runc` (the default) and `podvm`, the latter built from the packaged snippet
packaging/containerd/config-v2.toml so that the snippet users install is the one tested.
Pods use a locally built pause image, and either the node's network or a private CNI
bridge network (testbed/bridgenet.py) that this containerd's stop() removes, when the
machine has the CNI plugins.
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import tomllib
import uuid

from . import bridgenet, image
from .bytecode import compile_shim
from .cgroupdirs import cgroup_dirs, remove_below
from .namespaces import run_namespace
from .vmconfig import vmm_env

SHIM_BIN_DIR = pathlib.Path(sys.executable).parent  # the venv with containerd-shim-podvm-v2
REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
PODVM_SNIPPET = REPO_ROOT / "packaging" / "containerd" / "config-v2.toml"
CRI_PLUGIN = "io.containerd.grpc.v1.cri"
CRI_NAMESPACE = "k8s.io"  # where the CRI plugin keeps its images, containers and tasks


class Containerd:
    def __init__(self, workdir: pathlib.Path, namespace: str = run_namespace("podvm-ctr-test"), cri: bool = False,
                 podvm_config: str | os.PathLike | None = None, vmm: str = "qemu") -> None:
        """`vmm`: what its podvm shims make their pods' VMs with (testbed/vmconfig.py
        VMMS: "fake" for testbed/fakevm.py's; its configuration must keep no templates)."""
        self.workdir = workdir
        self.vmm = vmm
        self.namespace = namespace
        self.cri = cri
        self.podvm_config = None if podvm_config is None else str(podvm_config)
        self.root = workdir / "root"
        self.state = workdir / "state"
        self.address = str(workdir / "containerd.sock")
        self.ttrpc_address = self.address + ".ttrpc"
        self.config = workdir / "config.toml"
        self.log_path = workdir / "containerd.log"
        self.cni_dir = workdir / "cni"
        # Pods on the POD network get this (made by start() when the machine can).
        self.network: bridgenet.BridgeNetwork | None = None
        self.process: subprocess.Popen | None = None
        # Tests' pods go under a cgroup parent of their own (LinuxPodSandboxConfig
        # .cgroup_parent), which stop() removes: without one, runc leaves /k8s.io in every
        # hierarchy, shared with any other containerd on the machine.
        self.cgroup_parent = f"/podvm-test-{uuid.uuid4().hex[:12]}"
        self._cgroups_before: set[str] = set()
        # What stop() had to force or could not clean (pods it could not remove, shims
        # left running, our cgroups left): each is a failure of the test that ran.
        self.forced: list[str] = []

    @property
    def cri_endpoint(self) -> str:
        return "unix://" + self.address

    def config_text(self) -> str:
        text = f"""\
version = 2
root = "{self.root}"
state = "{self.state}"
disabled_plugins = {'[]' if self.cri else json.dumps([CRI_PLUGIN])}

[grpc]
  address = "{self.address}"

[ttrpc]
  address = "{self.ttrpc_address}"

[debug]
  level = "debug"

# Managed binaries (none here): keep containerd from making /opt/containerd.
[plugins."io.containerd.internal.v1.opt"]
  path = "{self.root / 'opt'}"

# No NRI: containerd 2.x turns it on and leaves /var/run/nri/nri.sock behind (1.6 has
# no such plugin and ignores the section).
[plugins."io.containerd.nri.v1.nri"]
  disable = true
  socket_path = "{self.state / 'nri.sock'}"
"""
        if self.cri:
            text += self._cri_config() + "\n" + podvm_runtime_section(self.podvm_config)
        return text

    def _cri_config(self) -> str:
        # The streaming server (exec/attach URLs) must not take the system's port 10010.
        # Without CAP_SYS_RESOURCE (some CI sandboxes drop it) runc cannot lower a
        # process's oom_score_adj, and CRI asks -998 for every pause container: there,
        # restrict_oom_score_adj keeps each at no lower than containerd's own.
        return f"""
[plugins."{CRI_PLUGIN}"]
  sandbox_image = "{image.PAUSE_IMAGE_NAME}"
  restrict_oom_score_adj = {str(not _has_cap_sys_resource()).lower()}
  stream_server_address = "127.0.0.1"
  stream_server_port = "{_free_port()}"

  # Our own network configuration only (never the system's): the private bridge
  # network, or none (an empty directory) on a machine without the CNI plugins.
  [plugins."{CRI_PLUGIN}".cni]
    bin_dir = "{bridgenet.CNI_BIN_DIR if self.network else self.cni_dir / 'bin'}"
    conf_dir = "{self.cni_dir / 'net.d'}"

  [plugins."{CRI_PLUGIN}".containerd]
    default_runtime_name = "runc"

  [plugins."{CRI_PLUGIN}".containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"

  # runc's container state here, not in the machine-wide /run/containerd/runc.
  [plugins."{CRI_PLUGIN}".containerd.runtimes.runc.options]
    Root = "{self.state / 'runc'}"
"""

    def start(self, timeout: float = 30) -> "Containerd":
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self.cri and self.network is None and not bridgenet.missing_prerequisites():
            self.network = bridgenet.create(self.cni_dir)
            bridgenet.write_conflist(self.network, self.cni_dir / "net.d")
        try:
            return self._start(timeout)
        except BaseException:
            self._remove_network()
            raise

    def _start(self, timeout: float) -> "Containerd":
        self.config.write_text(self.config_text())
        compile_shim()  # the benches' and the demo's shims run as a node's would
        self._cgroups_before = set(cgroup_dirs(CRI_NAMESPACE) + cgroup_dirs(self.namespace))
        # containerd's environment is its shims': the VMM they use is chosen there
        env = vmm_env(dict(os.environ, PATH=f"{SHIM_BIN_DIR}:{os.environ.get('PATH', '')}"),
                      self.vmm)
        self._log = open(self.log_path, "ab")
        self.process = subprocess.Popen(["containerd", "--config", str(self.config)],
                                        stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                        start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"containerd exited {self.process.returncode}:\n{self.log()}")
            if os.path.exists(self.address) and self.ctr("version", check=False).returncode == 0:
                if not self.cri or self._cri_ready():
                    return self
            time.sleep(0.1)
        raise RuntimeError(f"containerd did not come up in {timeout}s:\n{self.log()}")

    def _cri_ready(self) -> bool:
        from .criclient import CriClient, CriError  # grpc only for CRI harnesses

        with CriClient(self.cri_endpoint, timeout=2) as client:
            try:
                client.runtime("Version", _cri().VersionRequest())
            except CriError:
                return False
        return True

    def ctr(self, *args: str, check: bool = True, timeout: float = 120,
            input: bytes | None = None, namespace: str | None = None
            ) -> subprocess.CompletedProcess:
        result = subprocess.run(["ctr", "--address", self.address, "--namespace",
                                 namespace or self.namespace, *args], capture_output=True,
                                timeout=timeout, input=input)
        if check and result.returncode != 0:
            raise RuntimeError(f"ctr {' '.join(args)} exited {result.returncode}: "
                               f"{result.stderr.decode(errors='replace')}")
        return result

    def import_busybox(self, cache: pathlib.Path) -> str:
        archive = image.build_archive(cache / "busybox-oci.tar")
        self.ctr("images", "import", str(archive))
        return image.IMAGE_NAME

    def import_cri_images(self, cache: pathlib.Path) -> str:
        """busybox and the pause image into the CRI's namespace; returns busybox's name."""
        for archive in (image.build_archive(cache / "busybox-oci.tar"),
                        image.build_pause_archive(cache / "pause-oci.tar")):
            self.ctr("images", "import", str(archive), namespace=CRI_NAMESPACE)
        return image.IMAGE_NAME

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def remove_everything(self) -> None:
        """Every pod through the CRI (so it unmounts /dev/shm and forgets them), then any
        task and container through containerd: their shims exit with them, which they
        would not do when containerd stops."""
        if self.cri:
            from .criclient import CriClient

            api = _cri()
            with CriClient(self.cri_endpoint, timeout=60) as client:
                for pod in client.runtime("ListPodSandbox", api.ListPodSandboxRequest()).items:
                    client.runtime("StopPodSandbox",
                                   api.StopPodSandboxRequest(pod_sandbox_id=pod.id))
                    client.runtime("RemovePodSandbox",
                                   api.RemovePodSandboxRequest(pod_sandbox_id=pod.id))
        namespaces = self.ctr("namespaces", "ls", "-q").stdout.decode().split()
        for ns in namespaces:
            for task in self.ctr("tasks", "ls", "-q", namespace=ns).stdout.decode().split():
                self.ctr("tasks", "kill", "-s", "SIGKILL", task, namespace=ns, check=False)
                self.ctr("tasks", "delete", "-f", task, namespace=ns, check=False)
            for ctr in self.ctr("containers", "ls", "-q", namespace=ns).stdout.decode().split():
                self.ctr("containers", "delete", ctr, namespace=ns, check=False)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            try:
                self.remove_everything()
            except Exception as exc:  # keep tearing down; the shim check below reports it
                self.forced.append(f"removing pods and tasks failed: {exc}")
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if getattr(self, "_log", None):
            self._log.close()
        for pid, cmdline in shims_of(self.address):
            self.forced.append(f"killed shim {pid}: {cmdline}")
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for mount in reversed(mounts_under(self.workdir)):
            subprocess.run(["umount", "-l", mount], check=False)
        self._remove_cgroups()
        self.forced += self._remove_network()
        shutil.rmtree(self.root, ignore_errors=True)
        shutil.rmtree(self.state, ignore_errors=True)
        shutil.rmtree(self.cni_dir, ignore_errors=True)

    def _remove_network(self) -> list[str]:
        """The bridge network and what CNI left of it (pods removed through the CRI
        leave nothing: what had to go here is returned)."""
        if self.network is None:
            return []
        network, self.network = self.network, None
        return bridgenet.remove(network)

    def _remove_cgroups(self) -> None:
        """Our pods' cgroup parent, and the per-namespace parents runc made for containers
        without one (only those this run created, only when empty)."""
        ours = cgroup_dirs(self.cgroup_parent.strip("/"))
        made = [d for d in cgroup_dirs(CRI_NAMESPACE) + cgroup_dirs(self.namespace)
                if d not in self._cgroups_before]
        for top in ours + made:
            try:
                remove_below(top)
            except OSError as exc:
                if top in ours:
                    self.forced.append(f"cgroup {exc.filename} left: {exc.strerror}")

    def __enter__(self) -> "Containerd":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _cri():
    from podvm_core.pb.cri import api_pb2

    return api_pb2


def podvm_runtime_section(config_path: str | None) -> str:
    """The packaged podvm runtime snippet, with ConfigPath replaced when one is given."""
    text = PODVM_SNIPPET.read_text()
    if config_path is not None:
        text, count = re.subn(r'(?m)^(\s*)ConfigPath\s*=\s*"[^"\n]*"[ \t]*$',
                              lambda m: f"{m.group(1)}ConfigPath = {json.dumps(config_path)}",
                              text)
        if count != 1:
            raise RuntimeError(f"{PODVM_SNIPPET}: expected one ConfigPath line, found {count}")
    runtime = tomllib.loads(text)["plugins"][CRI_PLUGIN]["containerd"]["runtimes"]["podvm"]
    if runtime.get("runtime_type") != "io.containerd.podvm.v2":
        raise RuntimeError(f"{PODVM_SNIPPET}: runtime_type is not io.containerd.podvm.v2")
    return text


def _has_cap_sys_resource() -> bool:
    with open("/proc/self/status") as f:
        caps = next(line for line in f if line.startswith("CapEff:")).split()[1]
    return bool(int(caps, 16) >> 24 & 1)  # CAP_SYS_RESOURCE is capability 24


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mounts_under(path: pathlib.Path, pid: int | str = "self") -> list[str]:
    """Mount points at or below `path` in the mount namespace of `pid` (default: ours,
    the host's; a pod's shim and QEMU have their own, where the pod's mounts are)."""
    prefix = str(path)
    try:
        with open(f"/proc/{pid}/mountinfo") as f:
            points = [line.split()[4] for line in f]
    except OSError:  # gone
        return []
    return [p for p in points if p == prefix or p.startswith(prefix + "/")]


def mount_namespace(pid: int | str = "self") -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/mnt")
    except OSError:
        return None


def in_mount_namespace(namespace: str) -> list[int]:
    """Every process in the mount namespace `namespace` (`mnt:[inode]`): while one is,
    the namespace and the mounts in it live."""
    return [int(p) for p in os.listdir("/proc")
            if p.isdigit() and mount_namespace(p) == namespace]


def _processes(marker: bytes) -> list[tuple[int, str]]:
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmdline = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if marker in cmdline:
            found.append((int(pid), cmdline.replace(b"\0", b" ").decode(errors="replace")))
    return found


def podvm_shims() -> list[str]:
    """Command lines of every running podvm shim daemon."""
    return [cmdline for _, cmdline in _processes(b"containerd-shim-podvm-v2")]


def shims_of(address: str) -> list[tuple[int, str]]:
    """(pid, command line) of every shim (runc's or podvm's) serving the containerd at
    `address`: shims outlive containerd, so these are what a test run could leave."""
    found = []
    for pid, cmdline in _processes(b"containerd-shim-"):
        args = cmdline.split()
        # podvm's daemon runs as `python .../containerd-shim-podvm-v2 ...`
        program = next((a for a in args[:2] if "containerd-shim-" in os.path.basename(a)),
                       None)
        if program and address in args:
            found.append((pid, cmdline))
    return found
