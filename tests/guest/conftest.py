"""What the agent's tests of the pod's volumes share: the requests' directories, and the
volumes' place in a directory of this machine."""
from __future__ import annotations

import pathlib
from dataclasses import dataclass

import pytest

from guest.agent import volumes, writable


@dataclass
class Dir:  # as the request's LocalDir
    path: str
    mode: int = 0o777
    uid: int = 0
    gid: int = 0


@pytest.fixture
def volumes_root(tmp_path, monkeypatch) -> pathlib.Path:
    """Where guest/agent/volumes.py makes the pod's volumes, in a directory of the host
    standing for the scratch disk's (not made yet), which is then never mounted."""
    monkeypatch.setattr(volumes, "VOLUMES", str(tmp_path / "volumes"))
    monkeypatch.setattr(writable, "mount_scratch", lambda: None)
    return tmp_path / "volumes"
