"""The guest image drops a DT_NEEDED entry that protobuf's C backend carries without
using it (libstdc++): the edited module still loads, and names the others."""
from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

from guest.elfneeded import NotElf64, drop_needed, needed

UPB = next(pathlib.Path(p) for p in sys.path
           if (pathlib.Path(p) / "google/_upb").is_dir()) / "google/_upb/_message.abi3.so"


def test_needed_names_the_libraries_in_order() -> None:
    names = needed(UPB.read_bytes())
    assert "libc.so.6" in names and names == sorted(set(names), key=names.index)


def test_the_upb_module_without_libstdcxx_still_loads(tmp_path) -> None:
    data = UPB.read_bytes()
    # guest/build.py drops it (UNUSED_NEEDED): a protobuf that no longer names it makes
    # that step dead, and the build would refuse it
    assert "libstdc++.so.6" in needed(data), needed(data)
    edited = drop_needed(data, "libstdc++.so.6")
    assert needed(edited) == [n for n in needed(data) if n != "libstdc++.so.6"]
    copy = tmp_path / "_message.abi3.so"
    copy.write_bytes(edited)
    code = f"""
import importlib.util, sys
spec = importlib.util.spec_from_file_location("google._upb._message", {str(copy)!r})
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
maps = open("/proc/self/maps").read()
assert {str(copy)!r} in maps and "libstdc++" not in maps, maps
"""
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_library_not_needed_or_a_static_file_is_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match="does not need"):
        drop_needed(UPB.read_bytes(), "libnothing.so.1")
    with pytest.raises(NotElf64):
        needed(b"#!/bin/sh\n")
