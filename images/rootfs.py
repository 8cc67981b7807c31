"""What goes into the images' root file systems beyond podvm's Python packages: Debian's
Python 3.11 and the libraries it and the wheels load, unpacked from the .debs of pinned
versions (guest/debian.py resolves and fetches them, as for the guest image) with no
maintainer script run; no shell, no package manager, no docs. Then the accounts
(root, and the unprivileged user the webhook runs as) and bytecode compiled at build
time, so Python never writes to a read-only root."""
from __future__ import annotations

import pathlib
import py_compile
import shutil
import subprocess
import tempfile

from guest.debian import download, remove, unpack, versions

WEBHOOK_PACKAGES = [
    "python3.11-minimal", "libpython3.11-minimal", "libpython3.11-stdlib", "libc6",
    "zlib1g", "libexpat1", "libffi8", "libbz2-1.0", "liblzma5", "libssl3", "libuuid1",
    "libcrypt1",
    # protobuf's C backend names libstdc++ (google/_upb/_message.abi3.so)
    "libstdc++6",
    # glibc loads libgcc_s for pthread_cancel and backtraces.
    "libgcc-s1"]
NODE_PACKAGES = ["libc6", "libselinux1", "libpcre2-8-0", "util-linux"]
"""The node image's own, beside the self-contained /opt/podvm (podvm_node/bundle.py):
nsenter, which podvm_node/install.py runs to restart the host's containerd."""
ONLY = {"util-linux": ["usr/bin/nsenter"]}
"""Packages of which an image takes these files alone."""
WEBHOOK_MOUNT_POINTS = ("etc/podvm-webhook/tls", "etc/podvm")
NONROOT = (65532, 65532)  # packaging/kubernetes/webhook.yaml's runAsUser and runAsGroup
PRUNE = [
    "usr/share/doc", "usr/share/man", "usr/share/info", "usr/share/lintian",
    "usr/share/locale", "usr/share/bug", "usr/share/gdb", "usr/share/binfmts",
    "usr/share/python3", "usr/share/zoneinfo", "usr/lib/x86_64-linux-gnu/gconv",
    "usr/bin/pydoc3.11", "usr/bin/pdb3.11", "sbin/ldconfig", "usr/bin/ldd",
    "usr/bin/localedef", "usr/bin/iconv", "usr/bin/getconf", "usr/bin/locale",
    "usr/bin/zdump", "usr/sbin/zic", "usr/bin/openssl",
    *(f"usr/lib/python3.11/{mod}" for mod in (
        "test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3", "pydoc_data",
        "config-3.11-x86_64-linux-gnu", "distutils", "venv", "lib-dynload/_test*",
        "lib-dynload/_xx*", "lib-dynload/xx*", "lib-dynload/_ctypes_test*", "turtle.py",
        # what needs libraries the images leave out (ncurses, readline, sqlite, Berkeley DB)
        "curses", "sqlite3", "dbm", "lib-dynload/_curses*", "lib-dynload/readline*",
        "lib-dynload/_sqlite3*", "lib-dynload/_dbm*", "lib-dynload/_gdbm*",
        "lib-dynload/nis*")),
    "usr/local/lib/python3.11/dist-packages/*.dist-info/RECORD"]


def pinned_packages(packages: list[str]) -> dict[str, str]:
    """The version of each package apt would fetch now: the installed one may be gone
    from the mirror (a point release replaces it), a pin that cannot be fetched is none."""
    found = versions(packages)
    missing = [p for p in packages if found.get(p, "(none)") == "(none)"]
    if missing:
        raise SystemExit(f"apt knows no version of {missing}: run apt-get update")
    return dict(sorted(found.items()))


def fetch_debs(pinned: dict[str, str], cache: pathlib.Path) -> dict[str, pathlib.Path]:
    """The .deb of each pinned version, from `cache` or fetched into it."""
    cache.mkdir(parents=True, exist_ok=True)
    wanted = {p: cache / f"{p}_{v.replace(':', '%3a')}.deb" for p, v in pinned.items()}
    missing = [p for p, path in wanted.items() if not path.exists()]
    if missing:
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            for deb in download([f"{p}={pinned[p]}" for p in missing], pathlib.Path(tmp)):
                name = subprocess.run(["dpkg-deb", "-f", str(deb), "Package"], check=True,
                                      capture_output=True, text=True).stdout.strip()
                deb.replace(wanted[name])
    return wanted


def stage_debian(debs: dict[str, pathlib.Path], staging: pathlib.Path,
                 mount_points: tuple[str, ...] = ()) -> None:
    """The packages' files (of those in ONLY, the files it names), the directories a
    container's runtime mounts on, `mount_points` (a read-only root, a snapshot view as
    `ctr run --read-only` makes, cannot make them), and the accounts."""
    for name, deb in sorted(debs.items()):
        if name not in ONLY:
            unpack(deb, staging)
            continue
        with tempfile.TemporaryDirectory() as tmp:
            unpack(deb, pathlib.Path(tmp))
            for rel in ONLY[name]:
                (staging / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(pathlib.Path(tmp) / rel, staging / rel)
    for d in ("tmp", "proc", "sys", "dev", "etc", "root", "run", *mount_points):
        (staging / d).mkdir(parents=True, exist_ok=True)
    (staging / "tmp").chmod(0o1777)
    uid, gid = NONROOT
    (staging / "etc/passwd").write_text(
        f"root:x:0:0:root:/root:/usr/sbin/nologin\nnonroot:x:{uid}:{gid}:nonroot:/nonexistent:"
        "/usr/sbin/nologin\n")
    (staging / "etc/group").write_text(f"root:x:0:\nnonroot:x:{gid}:\n")
    if (staging / "usr/bin/python3.11").exists():
        (staging / "usr/bin/python3").symlink_to("python3.11")


def prune(staging: pathlib.Path) -> None:
    """Drop what no process of the images uses, and sources of compiled extensions."""
    remove(staging, PRUNE)
    for cache in list(staging.rglob("__pycache__")):
        shutil.rmtree(cache)
    for pattern in ("*.pyi", "*.pyx", "*.pxd", "*.c", "*.h"):
        for path in staging.glob("usr/local/lib/python3.11/dist-packages/**/" + pattern):
            path.unlink()


def compile_python(staging: pathlib.Path, trees: list[str]) -> None:
    """Sourceless bytecode beside where each module was: Python never compiles at start
    (a read-only root could not keep it) and the image carries each module once. The
    hash-based form holds no time, so the bytes depend on the source only."""
    for tree in trees:
        base = staging / tree
        for path in sorted(base.rglob("*.py")):
            try:
                py_compile.compile(
                    str(path), cfile=str(path.with_suffix(".pyc")),
                    dfile="/" + str(path.relative_to(staging)), doraise=True,
                    invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
            except py_compile.PyCompileError:
                continue  # a few stdlib files are templates, not Python
            path.unlink()

