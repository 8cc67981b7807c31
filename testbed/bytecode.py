"""The harness tests and benchmarks share: the shim's packages compiled to bytecode before
a shim runs, as on a node."""
from __future__ import annotations

import compileall
import pathlib

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
# What a shim daemon imports, all of it this tree's (its other imports were compiled by pip).
SHIM_PACKAGES = ("shim", "cgroups", "podvm_core")


def compile_shim() -> None:
    """Bytecode for the shim's packages, as a node has it: pip and podvm-node's bundle
    compile what they install, but this tree is installed in place, and where Python may
    not write bytecode (PYTHONDONTWRITEBYTECODE) every shim process would compile its
    ~120 modules afresh (0.1 s of a pod's start, in every `start` and `delete` too).
    Quick when it is current: only a source newer than its bytecode is compiled."""
    for package in SHIM_PACKAGES:
        if not compileall.compile_dir(str(REPO_ROOT / package), quiet=1):
            raise RuntimeError(f"{package}: some of its modules do not compile")
