"""What a host must have before podvm-node changes anything on it: each check refuses
with one line (containerd_dropin.Refusal), and install runs them all first."""
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
from shim.host import paths

from .containerd_dropin import Refusal

CONTAINERD_BINARIES = ("/usr/bin/containerd", "/usr/local/bin/containerd")
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
    path = host + "/etc/podvm/configuration.toml"
    if not os.path.exists(path):
        path = bundled_config
    try:
        with open(path, "rb") as f:
            return tomllib.load(f).get("hypervisor", {}).get("qemu", {}).get("accel", "kvm")
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise Refusal(f"cannot read podvm's configuration {path}: {exc}") from None


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
