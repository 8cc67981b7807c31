"""`start` keeps the runtime options containerd writes to its stdin (a marshalled Any,
core/runtime/v2/binary.go in containerd) in the bundle, for the Sandbox API, which gets them
nowhere else; and never waits on a stdin that is not containerd's."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time

from shim.host.paths import RUNTIME_OPTIONS_FILE

_KEEP = "import sys; from shim.contract.manager import _keep_runtime_options as k; k(sys.argv[1])"


def _keep(bundle: pathlib.Path, **stdin) -> float:
    began = time.monotonic()
    subprocess.run([sys.executable, "-c", _KEEP, str(bundle)], check=True, timeout=30,
                   **stdin)
    return time.monotonic() - began


def test_the_options_on_stdin_are_kept_unchanged(tmp_path) -> None:
    data = b"\n\x27containerd.runtime.v1.Options\x12\x04\x12\x02/x"
    _keep(tmp_path, input=data)
    assert (tmp_path / RUNTIME_OPTIONS_FILE).read_bytes() == data


def test_no_options_no_file(tmp_path) -> None:
    _keep(tmp_path, stdin=subprocess.DEVNULL)
    _keep(tmp_path, input=b"")
    assert not (tmp_path / RUNTIME_OPTIONS_FILE).exists()


def test_a_pipe_no_one_closes_does_not_hold_start(tmp_path) -> None:
    read, write = os.pipe()
    try:
        assert _keep(tmp_path, stdin=read) < 5  # its wait is STDIN_WAIT, plus Python's start
    finally:
        os.close(read)
        os.close(write)
    assert not (tmp_path / RUNTIME_OPTIONS_FILE).exists()
