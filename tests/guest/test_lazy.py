"""Modules the agent's start imports without using them are deferred: they cost boot
time under TCG, and still work when something uses them."""
from __future__ import annotations

import subprocess
import sys

from guest.agent.lazy import Deferred, defer


def test_a_deferred_module_loads_on_first_use() -> None:
    name = "podvm_lazy_probe_module"
    code = f"""
import sys, pathlib, tempfile
d = tempfile.mkdtemp()
pathlib.Path(d, "{name}.py").write_text("VALUE = 42")
sys.path.insert(0, d)
from guest.agent.lazy import Deferred, defer
defer("{name}")
import {name}
assert isinstance({name}, Deferred) and {name}.__name__ == "{name}"
assert {name}.VALUE == 42
assert not isinstance(sys.modules["{name}"], Deferred)
"""
    subprocess.run([sys.executable, "-c", code], check=True)


def test_defer_leaves_an_imported_module_alone() -> None:
    defer("os")
    assert not isinstance(sys.modules["os"], Deferred)


def test_the_agent_starts_without_what_it_defers() -> None:
    code = """
import sys
import guest.agent.__main__
from guest.agent.lazy import Deferred
for name in ("tokenize", "textwrap", "calendar"):
    assert isinstance(sys.modules.get(name), Deferred), name
for name in ("glob", "fnmatch"):
    assert name not in sys.modules, name
import textwrap
assert textwrap.dedent("  x") == "x"
"""
    subprocess.run([sys.executable, "-c", code], check=True)
