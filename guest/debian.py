"""The guest's Debian packages: the versions apt would fetch (part of the image's cache
key), fetched and unpacked. The host's apt configuration is the source: `apt-get update`
first when a package cannot be resolved."""
from __future__ import annotations

import pathlib
import shutil
import subprocess

KERNEL_META = "linux-image-amd64"
"""The kernel's metapackage: the guest boots the kernel it points to."""


def run(*cmd: str, cwd: str | None = None) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=cwd).stdout


def kernel_package() -> str:
    """The versioned image package the metapackage points to."""
    for line in run("apt-cache", "depends", KERNEL_META).splitlines():
        line = line.strip()
        if line.startswith("Depends: linux-image-"):
            return line.split(": ", 1)[1]
    raise SystemExit(f"cannot resolve {KERNEL_META}: run apt-get update")


def versions(packages: list[str]) -> dict[str, str]:
    out = run("apt-cache", "policy", *packages)
    found, current = {}, None
    for line in out.splitlines():
        if not line.startswith(" "):
            current = line.rstrip(":")
        elif line.strip().startswith("Candidate:") and current:
            found[current] = line.split(":", 1)[1].strip()
    return found


def erofs_utils_version() -> str:
    """mkfs.erofs makes the root image: the installed one is an input too."""
    try:
        return run("dpkg-query", "-W", "-f=${Version}", "erofs-utils")
    except subprocess.CalledProcessError:
        raise SystemExit("mkfs.erofs is missing: install the erofs-utils package") from None


def download(packages: list[str], into: pathlib.Path) -> list[pathlib.Path]:
    into.mkdir(parents=True, exist_ok=True)
    subprocess.run(["apt-get", "download", "-q", *packages], check=True, cwd=into,
                   capture_output=True)
    return sorted(into.glob("*.deb"))


def unpack(deb: pathlib.Path, into: pathlib.Path) -> None:
    """The files of the package `deb` under `into` (no maintainer scripts run)."""
    subprocess.run(["dpkg-deb", "-x", str(deb), str(into)], check=True)


def remove(staging: pathlib.Path, patterns: list[str]) -> None:
    """What unpacked packages bring that nothing in the image uses (docs, man pages...):
    every path under `staging` matching one of `patterns` (globs), a tree removed whole."""
    for pattern in patterns:
        for target in staging.glob(pattern):
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            else:
                target.unlink()
