"""The Python half of the node bundle (podvm_node/bundle.py): Debian's Python 3.11
standard library, podvm's own packages, and its dependencies at the versions this
environment runs (pip, wheels only, no dependency resolution: the list is the closure
of podvm's requirements as installed here, so the bundle carries what the tests ran).

Debian's python3.11 finds its prefix from its own path (lib/python3.11/os.py above its
bin/), and its site module reads <prefix>/lib/python3/dist-packages: so the tree is
python/bin/python3.11, python/lib/python3.11, python/lib/python3/dist-packages."""
from __future__ import annotations

import importlib.metadata
import pathlib
import re
import shutil
import subprocess
import sys

from . import elfpatch

STDLIB = pathlib.Path("/usr/lib/python3.11")
STDLIB_LEFT_OUT = ("test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3",
                   "pydoc_data", "site-packages", "dist-packages", "venv", "distutils",
                   "config-3.11-x86_64-linux-gnu")
"""Never imported by podvm (tests, GUIs, installers, the static library)."""
PACKAGES = ("shim", "cgroups", "podvm_core", "podvmctl", "podvm_webhook", "podvm_node")
"""pyproject.toml's [tool.setuptools.packages.find]."""
DIST = "podvm"


class PythonBundleError(RuntimeError):
    pass


def pins(dist: str = DIST) -> dict[str, str]:
    """name -> version of every distribution podvm needs, as installed here: its
    requirements' closure, extras left out, and those a marker excludes here (not
    installed) skipped."""
    found: dict[str, str] = {}
    todo = [dist]
    while todo:
        name = todo.pop()
        for requirement in importlib.metadata.requires(name) or ():
            if "extra ==" in requirement:
                continue
            wanted = re.match(r"[A-Za-z0-9._-]+", requirement).group(0)
            key = re.sub(r"[-_.]+", "-", wanted).lower()
            if key in found:
                continue
            try:
                found[key] = importlib.metadata.version(wanted)
            except importlib.metadata.PackageNotFoundError:
                if ";" in requirement:
                    continue
                raise PythonBundleError(f"{name} needs {wanted}, not installed here "
                                        f"(make venv)") from None
            todo.append(wanted)
    return dict(sorted(found.items()))


def own_sources(root: pathlib.Path) -> list[pathlib.Path]:
    """podvm's packages as they go into the bundle (the generated protobuf modules
    too), no caches or tests."""
    files = []
    for package in PACKAGES:
        files += [p for p in (root / package).rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts
                  and (p.suffix == ".py" or p.name == "py.typed")]
    return sorted(files)


def stdlib_files() -> list[str]:
    """What the bundle takes from Debian for Python: the standard library's directory
    (dpkg names its packages) and the libraries its extension modules load."""
    files = [str(STDLIB)]
    for ext in sorted((STDLIB / "lib-dynload").glob("*.so")):
        files += elfpatch.host_libraries(str(ext)).values()
    return sorted(set(files))


def install(stage: pathlib.Path, root: pathlib.Path, versions: dict[str, str]) -> None:
    python = stage / "python"
    shutil.copytree(STDLIB, python / "lib" / "python3.11", symlinks=False,
                    ignore=lambda d, names: [n for n in names if n in STDLIB_LEFT_OUT])
    site = python / "lib" / "python3" / "dist-packages"
    site.mkdir(parents=True)
    requirements = [f"{name}=={version}" for name, version in versions.items()]
    out = subprocess.run([sys.executable, "-m", "pip", "install", "-q",
                          "--disable-pip-version-check", "--target", str(site), "--no-deps",
                          "--only-binary", ":all:", "--no-compile", *requirements],
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise PythonBundleError(f"pip install {' '.join(requirements)}: "
                                f"{out.stderr.strip()[-2000:]}")
    shutil.rmtree(site / "bin", ignore_errors=True)
    copy_sources(root, site)


def copy_sources(root: pathlib.Path, site: pathlib.Path) -> None:
    for path in own_sources(root):
        target = site / path.relative_to(root)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
