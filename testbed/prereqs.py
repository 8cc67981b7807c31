"""The harness tests and benchmarks share: what a test needs of the machine. In CI every
prerequisite must be there (a missing one fails the test); on a developer's machine a
missing one skips it, saying what to install."""
from __future__ import annotations

import os
import shutil

import pytest

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require(condition: bool, what: str) -> None:
    if condition:
        return
    if IN_CI:
        pytest.fail(f"prerequisite missing in CI: {what}")
    pytest.skip(f"needs {what} (`make test` installs it)")


def require_tool(name: str, package: str) -> str:
    path = shutil.which(name)
    require(path is not None, f"{name} (Debian package {package})")
    assert path is not None
    return path


def require_root() -> None:
    require(os.geteuid() == 0, "root (containerd, mounts and cgroups need it)")
