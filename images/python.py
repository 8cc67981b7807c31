"""podvm and its Python dependencies in an image, installed by pip from pinned versions:
the dependencies pyproject.toml declares, and theirs, each at the version this
checkout's virtualenv runs (the versions the tests pass with). Wheels are kept in a cache
so a rebuild needs no network; podvm itself is a wheel built from a copy of its sources
(never in the checkout, where others build too)."""
from __future__ import annotations

import configparser
import hashlib
import importlib.metadata
import pathlib
import re
import shutil
import subprocess
import sys
import tomllib

from packaging.requirements import Requirement

ROOT = pathlib.Path(__file__).resolve().parents[1]
PODVM_SOURCES = ("pyproject.toml", "setup.py", "README.md", "protos", "shim", "cgroups",
                 "podvm_core", "podvmctl", "podvm_webhook", "podvm_node")
SITE = "usr/local/lib/python3.11/dist-packages"  # on Debian's python3.11 sys.path
PYTHON = "/usr/bin/python3.11"


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins() -> dict[str, str]:
    """name -> version of every package podvm needs at run time, from pyproject.toml
    down, at the versions installed in this virtualenv."""
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    found: dict[str, str] = {}
    todo = [Requirement(r) for r in declared]
    while todo:
        req = todo.pop()
        name = _canonical(req.name)
        if name in found or (req.marker and not req.marker.evaluate({"extra": ""})):
            continue
        try:
            version = importlib.metadata.version(req.name)
        except importlib.metadata.PackageNotFoundError:
            raise SystemExit(f"{req.name} is not installed in {sys.prefix}: run make venv")
        if version not in req.specifier:
            raise SystemExit(f"{req.name} {version} does not satisfy {req}: run make venv")
        found[name] = version
        todo += [Requirement(r) for r in importlib.metadata.requires(req.name) or []]
    return dict(sorted(found.items()))


def _source_files() -> list[pathlib.Path]:
    files = []
    for top in PODVM_SOURCES:
        path = ROOT / top
        if path.is_file():
            files.append(path)
            continue
        for f in sorted(path.rglob("*")):
            rel = f.relative_to(path).parts
            if f.is_file() and not (rel[:1] == ("pb",) and top == "podvm_core") and \
                    "__pycache__" not in rel and f.suffix != ".pyc":
                files.append(f)
    return files


def sources_digest() -> str:
    """podvm's sources that go into its wheel, hashed (part of an image's cache key)."""
    h = hashlib.sha256()
    for f in _source_files():
        h.update(str(f.relative_to(ROOT)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def podvm_wheel(work: pathlib.Path) -> pathlib.Path:
    """A wheel of podvm built from a copy of its sources under `work`."""
    src = work / "podvm-src"
    for f in _source_files():
        target = src / f.relative_to(ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(f, target)
    out = work / "podvm-wheel"
    _pip("wheel", "--no-deps", "--no-build-isolation", "-w", str(out), str(src))
    return next(out.glob("podvm-*.whl"))


def _pip(*args: str) -> None:
    result = subprocess.run([sys.executable, "-m", "pip", "-q", "--disable-pip-version-check",
                             *args], capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"pip {' '.join(args[:3])} ... failed:\n{result.stderr}")


def fetch_wheels(pinned: dict[str, str], cache: pathlib.Path) -> None:
    """Each pinned wheel into `cache` unless it is there (pip finds it without the
    network); one built from its sdist where PyPI has no wheel for this machine."""
    cache.mkdir(parents=True, exist_ok=True)
    have = {_canonical(w.name.split("-")[0]) + "==" + w.name.split("-")[1]
            for w in cache.glob("*.whl")}
    for name, version in pinned.items():
        if f"{name}=={version}" in have:
            continue
        spec = f"{name}=={version}"
        try:
            _pip("download", "--no-deps", "--only-binary=:all:", "-d", str(cache), spec)
        except SystemExit:
            _pip("wheel", "--no-deps", "-w", str(cache), spec)


def install(specs: list[str], find_links: list[pathlib.Path], staging: pathlib.Path) -> None:
    """`specs` (name==version each) into the image's site-packages under `staging`, from
    `find_links` only: no network, no resolver choosing versions."""
    _pip("install", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
         *(f"--find-links={d}" for d in find_links), "--target", str(staging / SITE), *specs)
    shutil.rmtree(staging / SITE / "bin", ignore_errors=True)  # scripts for this venv


def write_scripts(staging: pathlib.Path) -> dict[str, str]:
    """podvm's console scripts as /usr/local/bin scripts for the image's own Python
    (pip's would name this virtualenv's). Returns script name -> "module:function"."""
    entry_points = configparser.ConfigParser()
    entry_points.read(next((staging / SITE).glob("podvm-*.dist-info")) / "entry_points.txt")
    scripts = dict(entry_points["console_scripts"])
    bindir = staging / "usr/local/bin"
    bindir.mkdir(parents=True, exist_ok=True)
    for name, target in scripts.items():
        module, function = target.split(":")
        (bindir / name).write_text(f"#!{PYTHON}\nimport sys\nfrom {module} import "
                                   f"{function}\nsys.exit({function}())\n")
        (bindir / name).chmod(0o755)
    return scripts
