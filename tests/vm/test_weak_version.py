"""A version need marked weak (podvm_node/rust_virtiofsd.py weaken_version), on programs gcc
builds against a library of two versions, then run with the library's older build: what
makes Debian 13's virtiofsd load on Debian 12's glibc for the tests."""
from __future__ import annotations

import pathlib
import subprocess

import pytest

from podvm_node.rust_virtiofsd import WeakenError, weaken_version
from testbed.prereqs import require_tool

LIBRARY = """
int old_call(void) { return 1; }
#ifdef NEW
int new_call(void) { return 2; }
#endif
"""
NEW_MAP = "V_1 { global: old_call; local: *; };\nV_2 { global: new_call; } V_1;\n"
OLD_MAP = "V_1 { global: old_call; local: *; };\n"
WEAK_USER = """
#include <stdio.h>
extern int old_call(void);
extern int new_call(void) __attribute__((weak));
int main(void) { printf("%d %s\\n", old_call(), new_call ? "new" : "none"); return 0; }
"""
STRONG_USER = """
extern int old_call(void);
extern int new_call(void);
int main(void) { return old_call() + new_call(); }
"""


def _gcc(*args: str) -> None:
    gcc = require_tool("gcc", "gcc")
    done = subprocess.run([gcc, *args], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.fixture
def built(tmp_path: pathlib.Path) -> pathlib.Path:
    (tmp_path / "lib.c").write_text(LIBRARY)
    for name, text, define in (("new", NEW_MAP, ["-DNEW"]), ("old", OLD_MAP, [])):
        (tmp_path / name).mkdir()
        (tmp_path / f"{name}.map").write_text(text)
        _gcc("-shared", "-fPIC", *define, f"-Wl,--version-script={tmp_path}/{name}.map",
             "-Wl,-soname,libv.so", "-o", str(tmp_path / name / "libv.so"),
             str(tmp_path / "lib.c"))
    for name, source in (("weak", WEAK_USER), ("strong", STRONG_USER)):
        (tmp_path / f"{name}.c").write_text(source)
        _gcc("-o", str(tmp_path / name), str(tmp_path / f"{name}.c"), f"-L{tmp_path}/new",
             "-lv")
    return tmp_path


def _run(program: pathlib.Path, library: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(program)], capture_output=True, text=True,
                          env={"LD_LIBRARY_PATH": str(program.parent / library)})


def test_a_weak_need_lets_the_program_load_without_the_version(built) -> None:
    program = built / "weak"
    assert _run(program, "new").stdout == "1 new\n"
    refused = _run(program, "old")
    assert refused.returncode != 0 and "version `V_2' not found" in refused.stderr
    assert weaken_version(str(program), "V_2") == ["new_call"]
    ran = _run(program, "old")
    assert ran.returncode == 0 and ran.stdout == "1 none\n", ran  # it did without it
    assert "weak version `V_2' not found" in ran.stderr
    assert _run(program, "new").stdout == "1 new\n"  # where the version is, it is used


def test_a_strong_need_or_an_absent_version_is_refused_and_nothing_written(built) -> None:
    program = built / "strong"
    before = program.read_bytes()
    with pytest.raises(WeakenError, match="needs new_call of V_2: not weak"):
        weaken_version(str(program), "V_2")
    with pytest.raises(WeakenError, match="does not need version V_9"):
        weaken_version(str(program), "V_9")
    assert program.read_bytes() == before
    (built / "text").write_text("not elf")
    with pytest.raises(WeakenError, match="not a 64-bit little-endian ELF"):
        weaken_version(str(built / "text"), "V_2")
