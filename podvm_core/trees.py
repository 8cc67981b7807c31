"""podvm's versioned install trees (podvm_node/install.py): each installed bundle is its
own tree, /opt/podvm/<name> (<name>: 6 hex digits of the bundle's content, short enough
for its binaries' loader path /opt/podvm/<name>/lib/ld.so to fit where Debian's was),
and /opt/podvm/current links to the newest. A process knows its tree from its own
executable (the tree's Python, QEMU), so a shim started under one tree keeps to it
after an upgrade moves `current`: the configuration's /opt/podvm/bin/... and
/opt/podvm/current/... paths resolve into the caller's own tree (resolve). Trees no
process uses are removed by podvm_core/treegc.py. Light, standard library only: `start`
and `delete` import it."""
from __future__ import annotations

import os
import sys

PREFIX = "/opt/podvm"
CURRENT = "current"
NAME_LENGTH = 6
LAYOUT = ("bin", "lib", "libexec", "share", "python", "etc")
"""The bundle's top-level directories (podvm_node/bundle.py)."""
TREE_FILE = "podvm-tree"
"""In containerd's bundle directory: the tree whose shim started the container (`delete`
runs that tree's shim)."""


def is_name(name: str) -> bool:
    return len(name) == NAME_LENGTH and all(c in "0123456789abcdef" for c in name)


def tree_of(path: str) -> str | None:
    """The tree (/opt/podvm/<name>) `path` is inside, after links, or None."""
    real = os.path.realpath(path)
    if not real.startswith(PREFIX + "/"):
        return None
    name = real[len(PREFIX) + 1:].split("/", 1)[0]
    return f"{PREFIX}/{name}" if is_name(name) else None


def own() -> str | None:
    """The tree this process runs from (its Python's), None outside one (a checkout,
    `make install`'s venv)."""
    return tree_of(sys.executable)


def resolve(path: str, tree: str | None = None) -> str:
    """`path` as the tree `tree` (default: this process's own) has it: /opt/podvm/bin/x
    (the flat layout's, which /etc/podvm/configuration.toml names) and
    /opt/podvm/current/bin/x become <tree>/bin/x; any other path is kept."""
    tree = own() if tree is None else tree
    if not tree or not path.startswith(PREFIX + "/"):
        return path
    first, _, rest = path[len(PREFIX) + 1:].partition("/")
    if first == CURRENT:
        return f"{tree}/{rest}" if rest else tree
    if first in LAYOUT:
        return f"{tree}/{first}/{rest}" if rest else f"{tree}/{first}"
    return path


RETIRED = ".uninstalled"
"""In /opt/podvm after an uninstall that left trees in use: the directories install made
(one a line, parents first), which the last of their shims removes on its way out."""


def retired(host: str = "") -> bool:
    """Whether an uninstall left trees in use (its note, RETIRED, is there): only then has
    a pod's last process a collection to make (podvm_core/treegc.py)."""
    return os.path.exists(os.path.join(host + PREFIX, RETIRED))


def names(prefix: str) -> list[str]:
    """The trees under `prefix` (a host's /opt/podvm)."""
    try:
        return sorted(n for n in os.listdir(prefix) if is_name(n) and
                      os.path.isdir(os.path.join(prefix, n)) and
                      not os.path.islink(os.path.join(prefix, n)))
    except FileNotFoundError:
        return []

