"""The harness tests and benchmarks share: the file-semantics probes (fsprobe.c, every
case; sqliteprobe.c, SQLite's inserts and locks) built static for the busybox image."""
from __future__ import annotations

import pathlib
import subprocess

from .prereqs import require, require_tool

PROBE_SOURCE = pathlib.Path(__file__).with_name("fsprobe.c")
SQLITE_SOURCE = pathlib.Path(__file__).with_name("sqliteprobe.c")
SQLITE_LIBRARY = "/usr/lib/x86_64-linux-gnu/libsqlite3.a"


def build_probe(directory: pathlib.Path) -> pathlib.Path:
    """fsprobe and sqliteprobe in `directory`, static: the busybox image has no libc
    (sqliteprobe links Debian's libsqlite3.a)."""
    gcc = require_tool("gcc", "gcc")
    require(pathlib.Path(SQLITE_LIBRARY).is_file(),
            f"{SQLITE_LIBRARY} (Debian package libsqlite3-dev)")
    for source, name, libraries in ((PROBE_SOURCE, "fsprobe", []),
                                    (SQLITE_SOURCE, "sqliteprobe", ["-lsqlite3", "-lm"])):
        built = subprocess.run([gcc, "-static", "-O2", "-o", str(directory / name),
                                str(source), *libraries],
                               capture_output=True, text=True, timeout=180)
        assert built.returncode == 0, f"gcc -static {source}:\n{built.stderr}"
    return directory / "fsprobe"
