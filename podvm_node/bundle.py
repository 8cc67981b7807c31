"""`python -m podvm_node.bundle --out DIR`: the self-contained podvm tree that
`podvm-node install` copies to /opt/podvm on a node, which then needs no Python or QEMU
of its own. Everything comes from this machine's Debian packages (the binaries and
every shared library they load, ldd's closure), the guest image (build/guest) and
podvm's own packages with their pinned dependencies, and the Rust virtiofsd
(build/virtiofsd: Debian 13's, which this machine's Debian 12 may not have):

    lib/            the dynamic loader (as lib/ld.so) and every shared library;
                    QEMU's TCG module (lib/x86_64-linux-gnu/qemu)
    bin/            qemu-system-x86_64, containerd-shim-podvm-v2, podvmctl, podvm-node,
                    mke2fs (the scratch disks' blank file system)
    libexec/        virtiofsd: the Rust one podvm ships (podvm_node/rust_virtiofsd.py,
                    `make virtiofsd`), the pods' file server by default
    share/qemu/     the firmware podvm's QEMU command line loads
    share/podvm/    vmlinux, initrd.img, rootfs.img
    python/         Python 3.11: bin/python3.11, lib/python3.11 (the standard library),
                    lib/python3/dist-packages (podvm and its dependencies)
    etc/configuration.toml, manifest.json, inputs.sha256

Each binary's interpreter is /opt/podvm/lib/ld.so (`podvm-node install` rewrites it to
its tree's, /opt/podvm/<name>/lib/ld.so: podvm_node/hostfiles.py) and its RUNPATH leads
to lib/ from $ORIGIN (podvm_node/elfpatch.py), so nothing is looked up in the host's /usr. QEMU finds
its firmware beside itself (QEMU looks in ../share/qemu relative to its binary; the
shim's -bios path and QEMU's jail follow the binary: shim/vm/qemu/command.py,
shim/vm/qemu/jail.py). Built again only when its inputs change (inputs.sha256, as
guest/build.py does), into a new directory renamed into place."""
from __future__ import annotations

import argparse
import compileall
import hashlib
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

from . import bundle_python, elfpatch, hostfiles

PREFIX = "/opt/podvm"
LOADER = "lib/ld.so"
"""Short enough to be written over /lib64/ld-linux-x86-64.so.2 in place."""
ROOT = pathlib.Path(__file__).resolve().parents[1]
GUEST = ROOT / "build" / "guest"
CONFIG_SOURCE = ROOT / "packaging" / "configuration.toml"
GUEST_FILES = ("vmlinux", "initrd.img", "rootfs.img")
RUST_VIRTIOFSD = ROOT / "build" / "virtiofsd"
"""podvm_node/rust_virtiofsd.py's output: the binary and its VERSION."""
EXECUTABLES = {"bin/qemu-system-x86_64": "/usr/bin/qemu-system-x86_64",
               "libexec/virtiofsd": str(RUST_VIRTIOFSD / "virtiofsd"),
               "bin/mke2fs": "/sbin/mke2fs",
               "python/bin/python3.11": "/usr/bin/python3.11"}
FIRMWARE_DIRS = ("/usr/share/qemu", "/usr/share/seabios", "/usr/lib/ipxe/qemu")
FIRMWARE = ("qboot.rom", "pvh.bin", "linuxboot_dma.bin", "linuxboot.bin", "kvmvapic.bin",
            "multiboot_dma.bin")
"""What QEMU 7.2 may load for podvm's machine (q35, -bios qboot.rom, -kernel: the PVH
and Linux boot option ROMs, KVM's TPR patching ROM); the NICs have romfile= empty."""
QEMU_MODULES = "/usr/lib/x86_64-linux-gnu/qemu"
MODULES = ("accel-tcg-x86_64.so",)
"""Debian builds TCG as a module; QEMU looks for modules relative to its binary too
(lib/x86_64-linux-gnu/qemu under the prefix)."""
SCRIPTS = {"containerd-shim-podvm-v2": "shim.contract.cli",
           "podvmctl": "podvmctl.cli", "podvm-node": "podvm_node.cli",
           "podvm-webhook": "podvm_webhook.cli"}
OWN_BUILDS = ("libexec/virtiofsd",)
"""Executables that are no package of this machine's (their libraries are): the manifest
names their version and digest."""
UNTOUCHED_LIBS = ("ld-linux-x86-64.so.2", "libc.so.6")
"""Need nothing but each other: left exactly as Debian ships them."""
CONFIG_PATHS = {"path": "bin/qemu-system-x86_64", "kernel": "share/podvm/vmlinux",
                "initrd": "share/podvm/initrd.img", "image": "share/podvm/rootfs.img",
                "virtio_fs_daemon": "libexec/virtiofsd", "scratch_mke2fs": "bin/mke2fs"}


class BundleError(RuntimeError):
    pass


def debian_owners(paths: list[str]) -> dict[str, str]:
    """package -> version of the Debian packages `paths` come from (merged /usr: a
    path may be known to dpkg under /lib or /usr/lib). Two dpkg-query calls for all."""
    aliases = {}
    for path in paths:
        for candidate in (path, re.sub(r"^/usr/", "/", path), "/usr" + path):
            aliases.setdefault(candidate, path)
    out = subprocess.run(["dpkg-query", "-S", *aliases], capture_output=True, text=True)
    owners, found = set(), set()
    for line in out.stdout.splitlines():
        packages, _, path = line.partition(": ")
        if path in aliases:
            found.add(aliases[path])
            owners.update(p.strip().split(":")[0] for p in packages.split(","))
    missing = sorted(set(paths) - found)
    if missing:
        raise BundleError(f"{', '.join(missing)}: in no Debian package")
    out = subprocess.run(["dpkg-query", "-W", "-f=${Package} ${Version}\n", *sorted(owners)],
                         capture_output=True, text=True, check=True)
    return dict(sorted(line.split(" ", 1) for line in out.stdout.splitlines()))


def sources_digest() -> str:
    """podvm's own packages as the bundle carries them."""
    digest = hashlib.sha256()
    for path in bundle_python.own_sources(ROOT):
        digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def host_files() -> list[str]:
    """The host files the bundle copies (before the Python tree's extensions), all of
    them Debian's (OWN_BUILDS' libraries too, not the builds)."""
    files = [source for rel, source in EXECUTABLES.items() if rel not in OWN_BUILDS]
    for exe in EXECUTABLES.values():
        files += elfpatch.host_libraries(exe).values()
    files += [firmware_source(name) for name in FIRMWARE]
    for name in MODULES:
        module = os.path.join(QEMU_MODULES, name)
        files += [module, *elfpatch.host_libraries(module).values()]
    return sorted(set(files))


def own_builds() -> dict[str, dict[str, str]]:
    """OWN_BUILDS' version and digest (a new Debian 13 virtiofsd is a new bundle)."""
    found = {}
    for rel in OWN_BUILDS:
        source = pathlib.Path(EXECUTABLES[rel])
        version = source.with_name("VERSION")
        if not source.is_file() or not version.is_file():
            raise BundleError(f"no Rust virtiofsd in {source.parent}: run `make virtiofsd` "
                              f"first")
        found[rel] = {"version": version.read_text().strip(),
                      "sha256": hashlib.sha256(source.read_bytes()).hexdigest()}
    return found


def firmware_source(name: str) -> str:
    for directory in FIRMWARE_DIRS:
        path = os.path.join(directory, name)
        if os.path.exists(path):
            return os.path.realpath(path)
    raise BundleError(f"QEMU firmware {name} is in none of {FIRMWARE_DIRS}")


def inputs() -> tuple[str, dict]:
    """The cache key and the manifest: Debian packages, Python distributions, podvm's
    sources, the guest image's own key."""
    stamp = GUEST / "inputs.sha256"
    if not stamp.is_file():
        raise BundleError(f"no guest image in {GUEST}: run `make guest` first")
    debian_files = host_files() + bundle_python.stdlib_files()
    manifest = {"prefix": PREFIX,
                "debian": debian_owners(debian_files),
                "own_builds": own_builds(),
                "python": bundle_python.pins(),
                "podvm_sources": sources_digest(),
                "guest": stamp.read_text().strip(),
                "configuration": hashlib.sha256(CONFIG_SOURCE.read_bytes()).hexdigest(),
                "firmware": list(FIRMWARE), "qemu_modules": list(MODULES)}
    return hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest(), manifest


def build(out: pathlib.Path, force: bool = False) -> bool:
    """Build the bundle into `out` unless it is up to date; True when it was built."""
    key, manifest = inputs()
    stamp = out / "inputs.sha256"
    if not force and stamp.is_file() and stamp.read_text().strip() == key:
        return False
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = pathlib.Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        if not force and only_sources_differ(out, manifest):
            refresh_sources(out, stage)
        else:
            assemble(stage, manifest)
        (stage / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True)
                                             + "\n")
        stage.chmod(0o755)
        check(stage)
        (stage / "inputs.sha256").write_text(key + "\n")
        old = out.with_name(out.name + ".old")
        if out.exists():
            os.rename(out, old)
        os.rename(stage, out)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return True


def assemble(stage: pathlib.Path, manifest: dict) -> None:
    for sub in ("lib", "bin", "libexec", "share/qemu", "share/podvm", "etc"):
        (stage / sub).mkdir(parents=True, exist_ok=True)
    for rel, source in EXECUTABLES.items():
        (stage / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, stage / rel)
    bundle_python.install(stage, ROOT, manifest["python"])
    modules = stage / QEMU_MODULES.replace("/usr/", "", 1)
    modules.mkdir(parents=True)
    for name in MODULES:
        shutil.copy2(os.path.join(QEMU_MODULES, name), modules / name)
    libraries: dict[str, str] = {}
    for elf in elf_files(stage):
        libraries.update(elfpatch.host_libraries(str(elf), inside=str(stage)))
    for name, source in libraries.items():
        target = stage / (LOADER if name == "ld-linux-x86-64.so.2" else f"lib/{name}")
        shutil.copy2(os.path.realpath(source), target)
    relink(stage, libraries)
    for name in FIRMWARE:
        shutil.copy2(firmware_source(name), stage / "share/qemu" / name)
    for name in GUEST_FILES:
        subprocess.run(["cp", "--sparse=always", str(GUEST / name),
                        str(stage / "share/podvm" / name)], check=True)
    write_scripts(stage)
    write_config(stage)
    compileall.compile_dir(str(stage / "python/lib/python3/dist-packages"), quiet=1,
                           workers=1)


def only_sources_differ(out: pathlib.Path, manifest: dict) -> bool:
    """Whether the bundle in `out` differs from `manifest` in podvm's own sources or
    configuration only (what changes most): then the rest is copied, not rebuilt."""
    try:
        old = json.loads((out / "manifest.json").read_text())
    except (OSError, ValueError):
        return False
    light = ("podvm_sources", "configuration")
    return {k: v for k, v in old.items() if k not in light} == \
        {k: v for k, v in manifest.items() if k not in light}


def refresh_sources(out: pathlib.Path, stage: pathlib.Path) -> None:
    """`out` copied to `stage` with podvm's packages and configuration written anew."""
    stage.rmdir()
    hostfiles.copy_tree(str(out), str(stage))
    site = stage / "python/lib/python3/dist-packages"
    for package in bundle_python.PACKAGES:
        shutil.rmtree(site / package, ignore_errors=True)
    bundle_python.copy_sources(ROOT, site)
    write_config(stage)
    compileall.compile_dir(str(site), quiet=1, workers=1)


def elf_files(stage: pathlib.Path) -> list[pathlib.Path]:
    found = [stage / rel for rel in EXECUTABLES]
    modules = stage / QEMU_MODULES.replace("/usr/", "", 1)
    found += [p for p in [*(stage / "python").rglob("*.so*"), *modules.glob("*.so")]
              if p.is_file() and elfpatch.is_elf(str(p))]
    return found


def relink(stage: pathlib.Path, libraries: dict[str, str]) -> None:
    """Executables: the bundle's loader and lib/; its libraries: each other; the Python
    tree's extensions that need a host library: lib/ too."""
    lib = stage / "lib"
    for rel in EXECUTABLES:
        exe = stage / rel
        elfpatch.set_interpreter(str(exe), f"{PREFIX}/{LOADER}")
        elfpatch.set_runpath(str(exe), "$ORIGIN/" + os.path.relpath(lib, exe.parent))
    for path in lib.iterdir():
        if path.is_file() and path.name not in UNTOUCHED_LIBS and path.name != "ld.so":
            elfpatch.set_runpath(str(path), "$ORIGIN")
    for ext in elf_files(stage)[len(EXECUTABLES):]:
        needs = elfpatch.host_libraries(str(ext), inside=str(stage)).keys()
        if needs - set(UNTOUCHED_LIBS) - {"libm.so.6", "libpthread.so.0"}:
            elfpatch.set_runpath(str(ext), "$ORIGIN/" + os.path.relpath(lib, ext.parent))


def write_scripts(stage: pathlib.Path) -> None:
    """Console scripts run by the bundle's Python, isolated (-I) from the caller's
    environment and user site."""
    for name, module in SCRIPTS.items():
        path = stage / "bin" / name
        path.write_text(f"#!{PREFIX}/python/bin/python3.11 -I\nimport sys\n"
                        f"from {module} import main\nsys.exit(main())\n")
        path.chmod(0o755)


def configuration_text(packaged: str) -> str:
    """packaging/configuration.toml with the paths of QEMU, virtiofsd and the guest
    under /opt/podvm (a key the packaged file leaves commented out is set)."""
    text = packaged
    for key, rel in CONFIG_PATHS.items():
        text, count = re.subn(rf'(?m)^(# )?{key} = "[^"\n]*"$', f'{key} = "{PREFIX}/{rel}"',
                              text)
        if count != 1:
            raise BundleError(f"packaging/configuration.toml: no single {key} line")
    return text.replace("Installed as /etc/podvm/configuration.toml by `make install`",
                        "Installed as /etc/podvm/configuration.toml by `podvm-node install`")


def write_config(stage: pathlib.Path) -> None:
    packaged = CONFIG_SOURCE.read_text()
    (stage / "etc" / "configuration.toml").write_text(configuration_text(packaged))


def check(stage: pathlib.Path) -> None:
    """Run the bundle's QEMU (with TCG, a module), virtiofsd and shim where they will
    live, /opt/podvm (a private mount namespace), with /usr's QEMU and Python out of
    sight."""
    script = (f"mount --make-rprivate / && mount -t tmpfs tmpfs /opt && mkdir /opt/podvm "
              f"&& mount --bind {stage} {PREFIX} && "
              f"for d in /usr/share/qemu /usr/lib/qemu /usr/lib/python3.11; do "
              f"[ -d $d ] && mount -t tmpfs tmpfs $d; done; "
              f"[ -d {QEMU_MODULES} ] && mount -t tmpfs tmpfs {QEMU_MODULES}; "
              f"echo quit | {PREFIX}/bin/qemu-system-x86_64 -machine none -accel tcg "
              f"-nodefaults -display none -monitor stdio >/dev/null && "
              f"{PREFIX}/libexec/virtiofsd --version && "
              f"{PREFIX}/bin/mke2fs -V && "
              f"{PREFIX}/bin/containerd-shim-podvm-v2 -v && "
              f"{PREFIX}/bin/podvmctl config --file {PREFIX}/etc/configuration.toml")
    out = subprocess.run(["unshare", "--mount", "sh", "-c", script], capture_output=True,
                         text=True, timeout=120)
    if out.returncode != 0:
        raise BundleError(f"the bundle does not run from {PREFIX}: "
                          f"{(out.stderr or out.stdout).strip()[-2000:]}")


def size(out: pathlib.Path) -> tuple[int, int]:
    """(apparent bytes, allocated bytes) of the tree."""
    apparent = allocated = 0
    for path in out.rglob("*"):
        if path.is_file() and not path.is_symlink():
            st = path.stat()
            apparent += st.st_size
            allocated += st.st_blocks * 512
    return apparent, allocated


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m podvm_node.bundle", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=pathlib.Path)
    parser.add_argument("--force", action="store_true", help="build even if up to date")
    args = parser.parse_args(argv)
    try:
        built = build(args.out.resolve(), force=args.force)
    except (BundleError, elfpatch.ElfPatchError, bundle_python.PythonBundleError) as exc:
        print(f"podvm bundle: {exc}", file=sys.stderr)
        return 1
    apparent, allocated = size(args.out)
    print(f"{'built' if built else 'up to date'}: {args.out} ({apparent >> 20} MiB, "
          f"{allocated >> 20} MiB on disk)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
