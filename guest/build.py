"""Build the guest image: Debian's kernel as an uncompressed vmlinux (QEMU boots it
through PVH); the root filesystem (busybox, python3, runc, the kernel modules a pod VM
needs and the podvm agent) as a read-only erofs image that every pod maps through
virtio-pmem with DAX, so the host's page cache holds it once for all pods and no guest
copies it into its RAM; and a small uncompressed initramfs (busybox and the modules that
mount that image). Everything comes from Debian packages and PyPI, by name and version,
so the same inputs give the same image. The packages are fetched by debian.py, the kernel
and its modules taken apart by kernel.py; this module assembles the image, and rebuilds it
only when its inputs (package versions, every source file under guest/ and the agent's)
change.

usage: python3 guest/build.py [--out DIR] [--force]
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import pathlib
import py_compile
import shutil
import subprocess
import sys
import tempfile
import zipfile

import google.protobuf

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from cpio import CpioWriter  # noqa: E402
from debian import (download, erofs_utils_version, kernel_package, remove, unpack,  # noqa: E402
                    versions)
from elfneeded import NotElf64, drop_needed, needed  # noqa: E402
from kernel import (MODULES, ON_DEMAND, ROOT_MODULES, extract_vmlinux,  # noqa: E402
                    module_names, module_paths, module_tree, on_demand_modules)

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "build" / "guest"

PACKAGES = ["busybox-static", "python3.11-minimal", "libpython3.11-minimal",
            "libpython3.11-stdlib", "libc6", "zlib1g", "libexpat1", "libffi8", "libbz2-1.0",
            "liblzma5", "libuuid1", "libcrypt1", "runc", "libseccomp2",
            # glibc loads libgcc_s for pthread_cancel and backtraces.
            "libgcc-s1"]
# protobuf's C backend (upb) names libstdc++ without using it (no symbol, no version):
# the name is dropped (elfneeded.py), so that libstdc++ is neither shipped nor mapped at
# each agent start.
UNUSED_NEEDED = {"google/_upb/_message.abi3.so": "libstdc++.so.6"}
# Not needed by a pod VM's agent, and large.
PRUNE = ["usr/share/doc", "usr/share/man", "usr/share/lintian", "usr/share/locale",
         "usr/share/zoneinfo", "usr/share/bug", "usr/share/gdb", "usr/share/binfmts",
         "usr/lib/x86_64-linux-gnu/gconv", "usr/share/python3", "usr/bin/pydoc3.11",
         "usr/lib/python3.11/test", "usr/lib/python3.11/idlelib", "usr/lib/python3.11/tkinter",
         "usr/lib/python3.11/ensurepip", "usr/lib/python3.11/lib2to3",
         "usr/lib/python3.11/pydoc_data", "usr/lib/python3.11/distutils",
         "usr/lib/python3.11/turtledemo", "usr/lib/python3.11/unittest",
         "usr/lib/python3.11/config-3.11-x86_64-linux-gnu", "usr/lib/python3.11/sqlite3",
         "usr/lib/python3.11/dbm", "usr/lib/python3.11/curses", "usr/lib/python3.11/venv",
         "usr/lib/python3.11/wsgiref", "usr/lib/python3.11/xmlrpc", "usr/lib/python3.11/http",
         "usr/lib/python3.11/email/architecture.rst", "usr/lib/python3.11/pydoc.py",
         "usr/lib/python3.11/email", "usr/lib/python3.11/html", "usr/lib/python3.11/xml",
         "usr/lib/python3.11/multiprocessing", "usr/lib/python3.11/urllib",
         "usr/lib/python3.11/lib-dynload/_codecs_*", "usr/lib/python3.11/lib-dynload/_test*",
         "usr/lib/python3.11/lib-dynload/_ssl*", "usr/lib/python3.11/lib-dynload/_hashlib*",
         "usr/lib/python3.11/lib-dynload/_decimal*", "usr/lib/python3.11/lib-dynload/_sqlite3*",
         "usr/lib/python3.11/lib-dynload/_curses*", "usr/lib/python3.11/lib-dynload/_dbm*",
         "usr/lib/python3.11/lib-dynload/readline*", "usr/lib/python3.11/lib-dynload/nis*",
         "usr/lib/python3.11/lib-dynload/ossaudiodev*", "usr/lib/python3.11/lib-dynload/xx*",
         "usr/lib/python3.11/lib-dynload/_xx*", "usr/lib/python3.11/lib-dynload/audioop*",
         "usr/lib/python3.11/lib-dynload/_ctypes_test*", "usr/lib/python3.11/lib-dynload/_lsprof*",
         "sbin/ldconfig", "usr/bin/ldd", "usr/bin/localedef", "usr/bin/iconv",
         "usr/bin/getconf", "usr/bin/locale", "usr/bin/zdump", "usr/bin/pdb3.11",
         # The kernel copies every byte of the (uncompressed) initramfs at boot, ~13 ms per
         # MiB under TCG: what neither python3, the agent nor runc loads goes too.
         "usr/share/gcc", "usr/lib/x86_64-linux-gnu/libexpatw*",
         *(f"lib/x86_64-linux-gnu/{lib}*" for lib in (
             "libmvec", "libBrokenLocale", "libanl", "libc_malloc_debug", "libmemusage",
             "libpcprofile", "libthread_db", "libnsl", "libnss_hesiod")),
         *(f"usr/lib/python3.11/{mod}" for mod in (
             "turtle.py", "_pydecimal.py", "decimal.py", "mailbox.py", "doctest.py", "pdb.py",
             "pickletools.py", "difflib.py", "imaplib.py", "nntplib.py", "smtplib.py",
             "smtpd.py", "ftplib.py", "poplib.py", "telnetlib.py", "cgi.py", "cgitb.py",
             "aifc.py", "sunau.py", "wave.py", "chunk.py", "sndhdr.py", "imghdr.py",
             "mailcap.py", "plistlib.py", "statistics.py", "pstats.py", "cProfile.py",
             "profile.py", "trace.py", "tabnanny.py", "pyclbr.py", "compileall.py",
             "zipapp.py", "webbrowser.py", "xdrlib.py", "nturl2path.py", "netrc.py", "uu.py",
             "_pyio.py", "zoneinfo", "tomllib", "asyncio/windows_events.py",
             "asyncio/windows_utils.py", "_osx_support.py", "_aix_support.py",
             "lib-dynload/_multibytecodec.*",
             "lib-dynload/_zoneinfo.*", "lib-dynload/_crypt.*", "crypt.py"))]
# Python's start-up needs these codecs; the rest of encodings/ is dead weight here.
KEEP_ENCODINGS = {"__init__", "aliases", "utf_8", "utf_8_sig", "latin_1", "ascii", "idna",
                  "raw_unicode_escape", "unicode_escape", "utf_16", "utf_32", "punycode"}
AGENT_DIR = "/opt/podvm"
INIT = pathlib.Path(__file__).resolve().parent / "init"
# The root's mounts, which its /init makes with one `mount -a` (a process each costs
# tens of ms under TCG).
FSTAB = pathlib.Path(__file__).resolve().parent / "fstab"
INITRAMFS_INIT = pathlib.Path(__file__).resolve().parent / "initramfs-init"
# virtio-pmem maps the image into the VM's hot-plug area, where a DIMM plugged after it
# must start on a guest memory block (128 MiB): the image is padded to a whole number of
# them with a hole (no disk, no page cache).
IMAGE_ALIGN = 128 << 20
# The agent and the one package host and guest share; nothing of the shim goes in.
AGENT_SOURCES = [("guest/agent", "podvm_agent"), ("podvm_core", "podvm_core")]


def protobuf_version() -> str:
    return google.protobuf.__version__


def inputs_digest(kernel_pkg: str) -> tuple[str, dict]:
    """The image's cache key and what it hashes: the packages' versions, the module lists,
    and every source the image is made by or of (each .py under guest/, this builder's
    debian.py and kernel.py too, and the agent's sources)."""
    pinned = versions([kernel_pkg, *PACKAGES])
    sources = hashlib.sha256()
    for path in sorted([INIT, INITRAMFS_INIT, FSTAB, pathlib.Path(__file__),
                        *(ROOT / "guest").rglob("*.py")]):
        sources.update(str(path.relative_to(ROOT)).encode() + path.read_bytes())
    for _, (src, _) in enumerate(AGENT_SOURCES):
        for path in sorted((ROOT / src).rglob("*.py")) if (ROOT / src).is_dir() else [ROOT / src]:
            sources.update(str(path.relative_to(ROOT)).encode() + path.read_bytes())
    manifest = {"packages": pinned, "protobuf": protobuf_version(),
                "modules": {"initramfs": ROOT_MODULES, "root": MODULES, "on_demand": ON_DEMAND},
                "erofs-utils": erofs_utils_version(),
                "sources": sources.hexdigest()}
    return hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest(), manifest


def stage_root(debs: list[pathlib.Path], staging: pathlib.Path) -> None:
    for deb in debs:
        unpack(deb, staging)
    remove(staging, PRUNE)
    for codec in (staging / "usr/lib/python3.11/encodings").glob("*.py"):
        if codec.stem not in KEEP_ENCODINGS:
            codec.unlink()
    for cache in staging.rglob("__pycache__"):
        shutil.rmtree(cache)


def add_protobuf(staging: pathlib.Path, downloads: pathlib.Path) -> None:
    wheel_dir = downloads / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                    "--only-binary=:all:", "--python-version", "3.11", "--platform",
                    "manylinux2014_x86_64", "-d", str(wheel_dir),
                    f"protobuf=={protobuf_version()}"], check=True)
    wheel = next(wheel_dir.glob("protobuf-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        z.extractall(staging / AGENT_DIR.strip("/"))
    for rel, library in UNUSED_NEEDED.items():
        path = staging / AGENT_DIR.strip("/") / rel
        path.write_bytes(drop_needed(path.read_bytes(), library))


def check_needed(staging: pathlib.Path) -> None:
    """Every library an ELF file of the root names is in the root: what a library
    dropped from the packages leaves missing fails the build, not a pod's boot."""
    present = {p.name for p in staging.rglob("*.so*")}
    for path in staging.rglob("*"):
        if not path.is_file() or path.is_symlink():
            continue
        with open(path, "rb") as f:
            if f.read(4) != b"\x7fELF":
                continue
        try:
            missing = set(needed(path.read_bytes())) - present
        except NotElf64:
            continue
        if missing:
            raise SystemExit(f"{path.relative_to(staging)} needs {sorted(missing)}, "
                             f"which the root image lacks")


def add_agent(staging: pathlib.Path) -> None:
    base = staging / AGENT_DIR.strip("/")
    for src, dst in AGENT_SOURCES:
        source, target = ROOT / src, base / dst
        if source.is_dir():
            shutil.copytree(source, target, dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyi"))
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


def compile_python(staging: pathlib.Path) -> None:
    """Sourceless bytecode made here: under TCG, compiling at each boot costs seconds, and
    shipping only the .pyc halves the image (tracebacks still name the file and line)."""
    for tree, prefix in ((staging / "usr/lib/python3.11", "/usr/lib/python3.11"),
                         (staging / AGENT_DIR.strip("/"), AGENT_DIR)):
        for path in tree.rglob("*.py"):
            rel = path.relative_to(tree)
            try:
                py_compile.compile(str(path), cfile=str(path.with_suffix(".pyc")),
                                   dfile=f"{prefix}/{rel}", doraise=True,
                                   invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
            except py_compile.PyCompileError:
                continue  # a few stdlib files are templates, not Python
            path.unlink()


def busybox_applets(staging: pathlib.Path) -> list[str]:
    """Its applets' names (the list names busybox itself too)."""
    listed = subprocess.run([str(staging / "bin" / "busybox"), "--list"], check=True,
                            capture_output=True, text=True).stdout
    return [a for a in listed.split() if a != "busybox"]


def finish_root(staging: pathlib.Path, modroot: pathlib.Path, release: str,
                modules: list[pathlib.Path], on_demand: list[pathlib.Path]) -> None:
    """What the root image holds beyond the packages: busybox's applets, /init, its
    fstab, the modules it loads and those loaded on demand (one tree), and mount points
    (the root is read-only)."""
    for d in ("dev", "proc", "sys", "tmp", "run", "root", "mnt", "var"):
        (staging / d).mkdir(exist_ok=True)
    (staging / "var/run").symlink_to("/run")
    for applet in busybox_applets(staging):
        if not any((staging / where / applet).exists()
                   for where in ("bin", "usr/bin", "sbin", "usr/sbin")):
            (staging / "bin" / applet).symlink_to("busybox")
    (staging / "usr/bin/python3").symlink_to("python3.11")
    shipped = list(dict.fromkeys([*modules, *on_demand]))
    for rel, data in module_tree(modroot, shipped).items():
        target = staging / "lib/modules" / release / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    (staging / "sbin").mkdir(exist_ok=True)
    (staging / "sbin/modprobe").symlink_to("/bin/busybox")
    (staging / "etc/podvm-modules").write_text(module_names(modules))
    shutil.copyfile(FSTAB, staging / "etc/podvm-fstab")
    (staging / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    (staging / "etc/group").write_text("root:x:0:\n")
    shutil.copyfile(INIT, staging / "init")
    (staging / "init").chmod(0o755)


def write_root_image(staging: pathlib.Path, out: pathlib.Path) -> None:
    """Uncompressed erofs, every file's data in whole blocks (no inline tails): what
    DAX can map straight from the host's page cache. Fixed owners, times and UUID, so
    the image depends on its inputs only."""
    subprocess.run(["mkfs.erofs", "--quiet", "--all-root", "-T0", "-Enoinline_data",
                    "-U00000000-0000-0000-0000-000000000000", str(out), str(staging)],
                   check=True)
    with open(out, "r+b") as f:
        f.truncate(-(-f.seek(0, 2) // IMAGE_ALIGN) * IMAGE_ALIGN)


def write_initrd(busybox: pathlib.Path, applets: list[str], modroot: pathlib.Path,
                 release: str, modules: list[pathlib.Path], out: pathlib.Path) -> None:
    buf = io.BytesIO()
    cpio = CpioWriter(buf)
    for d in ("dev", "proc", "sys", "root"):
        cpio.directory(d)
    cpio.file("bin/busybox", busybox.read_bytes(), 0o755)
    for applet in applets:
        cpio.symlink(f"bin/{applet}", "busybox")
    for rel, data in module_tree(modroot, modules).items():
        cpio.file(f"lib/modules/{release}/{rel}", data)
    cpio.file("etc/podvm-modules", module_names(modules).encode())
    cpio.file("init", INITRAMFS_INIT.read_bytes(), 0o755)
    cpio.close()
    out.write_bytes(buf.getvalue())


OUTPUTS = ("vmlinux", "initrd.img", "rootfs.img")


def build(out: pathlib.Path, force: bool = False) -> None:
    kernel_pkg = kernel_package()
    digest, manifest = inputs_digest(kernel_pkg)
    stamp = out / "inputs.sha256"
    if not force and stamp.exists() and stamp.read_text().strip() == digest and \
            all((out / name).exists() for name in OUTPUTS):
        print(f"guest image in {out} is up to date ({digest[:12]})")
        return
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="podvm-guest-") as tmp:
        work = pathlib.Path(tmp)
        kernel_deb = download([kernel_pkg], work / "kernel")[0]
        kroot = work / "kroot"
        unpack(kernel_deb, kroot)
        vmlinuz = next((kroot / "boot").glob("vmlinuz-*"))
        release = vmlinuz.name.removeprefix("vmlinuz-")
        modroot = kroot / "lib/modules" / release
        early = module_paths(modroot, ROOT_MODULES)
        late = module_paths(modroot, MODULES, loaded=early)
        staging = work / "root"
        stage_root(download(PACKAGES, work / "debs"), staging)
        add_protobuf(staging, work)
        add_agent(staging)
        check_needed(staging)
        compile_python(staging)
        (staging / "etc").mkdir(exist_ok=True)
        (staging / "etc/podvm-release").write_text(release + "\n")
        demand = on_demand_modules(modroot)
        finish_root(staging, modroot, release, late, demand)
        on_demand = sorted(p.name.removesuffix(".ko").replace("-", "_") for p in demand)
        (out / "vmlinux.tmp").write_bytes(extract_vmlinux(vmlinuz.read_bytes()))
        write_initrd(staging / "bin/busybox", busybox_applets(staging), modroot, release,
                     early, out / "initrd.img.tmp")
        write_root_image(staging, out / "rootfs.img.tmp")
    for name in OUTPUTS:
        (out / f"{name}.tmp").replace(out / name)
    (out / "manifest.json").write_text(json.dumps(dict(manifest, kernel_release=release,
                                                       on_demand_modules=on_demand),
                                                  indent=2, sort_keys=True) + "\n")
    stamp.write_text(digest + "\n")
    mib = 1 << 20
    print(f"guest image in {out}: kernel {release}, "
          + ", ".join(f"{name} {(out / name).stat().st_size / mib:.1f} MiB" for name in OUTPUTS))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT,
                        help=f"output directory (default {DEFAULT_OUT})")
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    args = parser.parse_args()
    build(args.out.resolve(), args.force)
    return 0


if __name__ == "__main__":
    sys.exit(main())
