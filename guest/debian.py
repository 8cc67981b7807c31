"""The guest's Debian packages: the versions apt would fetch (part of the image's cache
key), fetched and unpacked. The host's apt configuration is the source of all but the
kernel (`apt-get update` first when a package cannot be resolved); the kernel comes
from Debian 12's backports (KERNEL_SOURCE) through an apt state of the build's own
(KernelApt), which leaves the host's configuration alone."""
from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

KERNEL_META = "linux-image-amd64"
"""The kernel's metapackage: the guest boots the kernel it points to."""
KERNEL_SOURCE = ("deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] "
                 "http://deb.debian.org/debian bookworm-backports main")
"""Debian 12's backported kernel (6.12): its overlayfs has O_TMPFILE (6.6 added it), which
a container's root needs (guest/agent/writable.py), and under TCG its ext4 and page cache
write 64 MiB in a container's root in 1.8 s against 2.6 (bookworm's 6.1)."""


def run(*cmd: str, cwd: str | None = None, env: dict[str, str] | None = None) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=cwd,
                          env=env).stdout


class KernelApt:
    """apt for the kernel alone: KERNEL_SOURCE's package lists in `root` (under the
    build directory), the host's dpkg status and keyrings."""

    def __init__(self, root: pathlib.Path) -> None:
        self.root = root
        for d in ("lists/partial", "archives/partial", "cache"):
            (root / d).mkdir(parents=True, exist_ok=True)
        (root / "sources.list").write_text(KERNEL_SOURCE + "\n")
        settings = {"Dir::Etc::SourceList": root / "sources.list",
                    "Dir::Etc::SourceParts": "/dev/null",
                    "Dir::Etc::PreferencesParts": "/dev/null",
                    "Dir::State::Lists": root / "lists",
                    "Dir::Cache": root / "cache", "Dir::Cache::Archives": root / "archives"}
        (root / "apt.conf").write_text("".join(f'{k} "{v}";\n' for k, v in settings.items()))
        self.env = dict(os.environ, APT_CONFIG=str(root / "apt.conf"))

    def run(self, *cmd: str, cwd: str | None = None) -> str:
        return run(*cmd, cwd=cwd, env=self.env)

    def kernel_package(self) -> str:
        """The versioned image package the metapackage points to, from lists fetched
        anew at each build (a backported kernel's security updates come there); the
        last lists when the mirror cannot be reached."""
        have_lists = any((self.root / "lists").glob("*Packages*"))
        try:
            self.run("apt-get", "update", "-q")
        except subprocess.CalledProcessError as exc:
            if not have_lists:
                raise SystemExit(f"cannot fetch the kernel's package list "
                                 f"({KERNEL_SOURCE}): {exc.stderr.strip()}") from None
            print(f"warning: the kernel's package list not refreshed ({KERNEL_SOURCE}): "
                  f"{exc.stderr.strip()[-300:]}", file=sys.stderr)
        try:
            depends = self.run("apt-cache", "depends", KERNEL_META)
        except subprocess.CalledProcessError as exc:
            depends = exc.stderr
        for line in depends.splitlines():
            if line.strip().startswith("Depends: linux-image-"):
                return line.strip().split(": ", 1)[1]
        raise SystemExit(f"cannot resolve {KERNEL_META} from {KERNEL_SOURCE}: "
                         f"{depends.strip()[-300:]}")

    def version(self, package: str) -> str:
        return versions([package], self.run)[package]

    def download(self, package: str, into: pathlib.Path) -> pathlib.Path:
        return download([package], into, self.run)[0]


def versions(packages: list[str], apt=run) -> dict[str, str]:
    out = apt("apt-cache", "policy", *packages)
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


def download(packages: list[str], into: pathlib.Path, apt=run) -> list[pathlib.Path]:
    into.mkdir(parents=True, exist_ok=True)
    apt("apt-get", "download", "-q", *packages, cwd=str(into))
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
