"""What a host must have before podvm-node changes anything on it: each check refuses
with one line (containerd_dropin.Refusal), and install runs them all first. One thing it
only warns about: kubelet's view of podvm pods' disk use (warn_scratch_mount)."""
from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import tomllib
from typing import Callable

from cgroups.detect import detect
from cgroups.errors import CgroupError
from cgroups.mounts import MOUNTINFO
from shim.config import HypervisorConfig
from shim.host import beneath, paths

from .containerd_dropin import Refusal

CONTAINERD_BINARIES = ("/usr/bin/containerd", "/usr/local/bin/containerd")
POD_LOGS = "/var/log/pods"
"""kubelet's pod log directory (its default podLogsDir), where the shim links each pod's
scratch disk for kubelet to count (shim/host/podlogdisk.py)."""
RESOLVE_IN_ROOT = 0x10
"""openat2: every path, an absolute symlink's too, resolved as if the host root were /."""
VersionProbe = Callable[[str], "str | None"]


def containerd_version_text(host: str) -> str | None:
    """`containerd --version` of the host's own binary, run in the host's root (its
    libraries); None when the host has none where containerd is installed."""
    return _run_containerd(host, "--version")


def containerd_default_config(host: str) -> str | None:
    """`containerd config default` of the same binary (the config version a release
    newer than podvm-node's table has); None as above."""
    return _run_containerd(host, "config", "default")


def _run_containerd(host: str, *args: str) -> str | None:
    for binary in CONTAINERD_BINARIES:
        if os.path.isfile(host + binary):
            argv = [binary, *args] if host in ("", "/") else ["chroot", host, binary, *args]
            out = subprocess.run(argv, capture_output=True, text=True, timeout=30)
            if out.returncode != 0:
                raise Refusal(f"{binary} {' '.join(args)} failed: "
                              f"{out.stderr.strip()[:200]}")
            return out.stdout
    return None


def accel(host: str, bundled_config: str) -> str:
    """The accel the node's podvm will run with: the host's configuration if it has
    one (install keeps it), else the bundle's."""
    return _qemu_section(host, bundled_config).get("accel", "kvm")


def _qemu_section(host: str, bundled_config: str) -> dict:
    """[hypervisor.qemu] of the configuration the node's podvm will run with."""
    path = host + "/etc/podvm/configuration.toml"
    if not os.path.exists(path):
        path = bundled_config
    try:
        with open(path, "rb") as f:
            return tomllib.load(f).get("hypervisor", {}).get("qemu", {})
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise Refusal(f"cannot read podvm's configuration {path}: {exc}") from None


def warn_scratch_mount(host: str, bundled_config: str, say: Callable[[str], None]) -> None:
    """Say one line where scratch_path is not on the mount of kubelet's pod log directory
    (or that cannot be told); nothing where it is, or where pods have no scratch disk. A link
    cannot cross mounts (EXDEV, even between two mounts of one file system), so there
    the shim runs each pod without its disk's name in the pod's log directory, logging
    why, and kubelet counts none of what podvm pods write. A warning, not a refusal: the
    pods still run, each bounded by its own disk and the node's reserve
    (shim/host/diskreserve.py); what is lost is kubelet's accounting, which the
    operator may accept or fix by moving scratch_path."""
    qemu, default = _qemu_section(host, bundled_config), HypervisorConfig()
    if not qemu.get("scratch_disk_mib", default.scratch_disk_mib):
        return
    scratch = qemu.get("scratch_path", default.scratch_path)
    try:
        if mount_id(host, scratch) == mount_id(host, POD_LOGS):
            return
        why = "is not on the mount of"
    except OSError as exc:
        why = f"cannot be compared ({exc.strerror or exc}) with"
    say(f"warning: scratch_path {scratch} {why} kubelet's pod log directory {POD_LOGS}: "
        f"the shim cannot link a pod's scratch disk there, so kubelet sees no disk use of "
        f"podvm pods (each is still bounded by its own disk): put scratch_path on that "
        f"mount (docs/install.md)")


def mount_id(host: str, path: str) -> int:
    """The mount `path` (its nearest existing ancestor: where the shim or kubelet would
    make it) is on, resolved in the host root; as /proc/self/fdinfo tells it."""
    root = os.open(host or "/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        at = os.path.normpath("/" + path)
        while True:
            try:
                fd = beneath.openat2(root, at.lstrip("/") or ".", os.O_PATH,
                                     RESOLVE_IN_ROOT | beneath.RESOLVE_NO_MAGICLINKS)
                break
            except FileNotFoundError:
                if at == "/":
                    raise
                at = os.path.dirname(at)
        try:
            with open(f"/proc/self/fdinfo/{fd}") as f:
                return next(int(line.split()[1]) for line in f
                            if line.startswith("mnt_id:"))
        finally:
            os.close(fd)
    finally:
        os.close(root)


def check_kvm(host: str, bundled_config: str) -> None:
    if accel(host, bundled_config) == "kvm" and not os.path.exists(host + "/dev/kvm"):
        raise Refusal("no /dev/kvm on this host and podvm's configuration says accel = "
                      "\"kvm\": enable virtualization (or set accel = \"tcg\" in "
                      "/etc/podvm/configuration.toml): nothing changed")


def check_cgroups(mountinfo: str = MOUNTINFO) -> None:
    """The shim's own detection (cgroups/detect.py): cgroup v2 at /sys/fs/cgroup, or v1
    with cpu and memory."""
    try:
        detect(mountinfo=mountinfo)
    except (CgroupError, OSError) as exc:
        said = re.sub(r"\s+", " ", str(exc))
        raise Refusal(f"a cgroup layout podvm does not know: {said}: nothing changed") \
            from None


def check_no_links(host: str, paths: tuple[str, ...]) -> None:
    """Every directory on the way to what install writes, and config.toml, is what it
    says: a symlink there would be followed in podvm-node's own root, not the host's (an
    absolute link in the mounted host root points into the container), so install
    would write outside the host, or into another place of it than it records."""
    for path in paths:
        at = ""
        for part in path.strip("/").split("/"):
            at += "/" + part
            if os.path.islink(host + at):
                raise Refusal(f"{at} on the host is a symlink (to {os.readlink(host + at)}): "
                              f"podvm-node does not follow links there: nothing changed")


def running_shims(host: str) -> list[str]:
    """The state directories of podvm shims still running on the host (shim.json with a
    live pid; the DaemonSet shares the host's pid namespace): uninstalling under them
    would take away the binary containerd runs to delete their pods."""
    found = []
    for state in sorted(glob.glob(host + paths.STATE_ROOT + "/*/*/shim.json")):
        try:
            with open(state) as f:
                pid = int(json.load(f)["pid"])
            os.kill(pid, 0)
        except (OSError, ValueError, KeyError, TypeError):
            continue
        found.append(os.path.dirname(state)[len(host):])
    return found
