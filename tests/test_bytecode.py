"""The shim's modules run from bytecode in tests, benches and the demo, as on a node
(testbed/bytecode.py compile_shim): a figure measured on a shim that compiles its sources
in every process is not a node's figure."""
from __future__ import annotations

import importlib.util
import os
import struct

from testbed.bytecode import REPO_ROOT, SHIM_PACKAGES, compile_shim


def _stale(package: str) -> list[str]:
    """Sources of `package` whose bytecode is missing or was made from another version."""
    stale = []
    for directory, _, files in os.walk(REPO_ROOT / package):
        for name in files:
            if not name.endswith(".py"):
                continue
            source = os.path.join(directory, name)
            try:
                with open(importlib.util.cache_from_source(source), "rb") as f:
                    header = f.read(16)
            except FileNotFoundError:
                stale.append(source)
                continue
            flags, mtime, size = struct.unpack("<III", header[4:16])
            st = os.stat(source)
            if header[:4] != importlib.util.MAGIC_NUMBER or flags != 0 or \
                    mtime != int(st.st_mtime) & 0xFFFFFFFF or size != st.st_size & 0xFFFFFFFF:
                stale.append(source)
    return stale


def test_the_shims_packages_have_current_bytecode_after_compile_shim():
    # a source made newer than its bytecode, as an edit makes it, is compiled again
    module = REPO_ROOT / "shim" / "network" / "errors.py"
    compile_shim()
    before = os.stat(module)
    os.utime(module, ns=(before.st_atime_ns, before.st_mtime_ns + 2_000_000_000))
    try:
        assert str(module) in _stale("shim")
        compile_shim()
        for package in SHIM_PACKAGES:
            assert _stale(package) == [], package
    finally:
        os.utime(module, ns=(before.st_atime_ns, before.st_mtime_ns))
        compile_shim()
