# What the root's /init loads from the image: virtiofs (built into Debian's 6.12) or 9p
# for the pod's share (shim/config.py's shared_fs), virtio_net for the pod's interfaces,
# virtio_balloon to hand the pages the guest frees back to the host, virtio_blk, ext4
# and overlay for the containers' writable layers on the pod's scratch disk
# (guest/agent/writable.py).
"""The guest's kernel from its Debian package: the uncompressed vmlinux QEMU boots, and
the kernel modules the guest gets (which ones, what they depend on, and the files busybox
modprobe reads to load them)."""
from __future__ import annotations

import functools
import lzma
import pathlib
import subprocess

# What the initramfs loads to mount the root image (their dependencies come with them
# through module_paths; crc32c_generic is libcrc32c's soft dependency, which .modinfo
# names by alias only).
ROOT_MODULES = ["virtio_pci", "virtio_pmem", "nd_pmem", "crc32c_generic", "erofs"]
# What the root's /init loads from the image: virtiofs (built into Debian's 6.12) or 9p
# for the pod's share
# (shim/config.py's shared_fs), virtio_net for the pod's interfaces,
# virtio_balloon to hand the pages the guest frees back to the host, virtio_blk, ext4
# and overlay for the containers' writable layers on the pod's scratch disk
# (guest/agent/writable.py).
MODULES = ["virtio_console", "virtiofs", "9pnet_virtio", "9p", "virtio_net", "virtio_balloon",
           "virtio_blk", "ext4", "overlay"]
# Loaded on demand, as on a node: what a privileged container (or one with NET_ADMIN or
# SYS_ADMIN) can use under runc and would miss in the guest: bridges, netfilter (nft and
# iptables), tun, cuse (fuse is built in), veth, dummy, VLAN, macvlan, ipvlan, vxlan.
# Paths under the kernel's module tree, globs allowed (a module compressed or not); what
# they depend on comes with them. They sit in the shared root image, so a pod pays for
# one only when it loads it.
ON_DEMAND = ["net/bridge/*.ko", "net/netfilter/*.ko", "net/netfilter/ipset/*.ko",
             "net/netfilter/ipvs/*.ko", "net/ipv4/netfilter/*.ko",
             "net/ipv6/netfilter/*.ko", "net/bridge/netfilter/*.ko", "net/8021q/*.ko",
             "drivers/net/tun.ko", "drivers/net/veth.ko", "drivers/net/dummy.ko",
             "drivers/net/macvlan.ko", "drivers/net/ipvlan/*.ko", "drivers/net/vxlan/*.ko",
             "fs/fuse/*.ko",
             # the text search conntrack helpers ask for by name (amanda, ...)
             "lib/ts_*.ko"]


def extract_vmlinux(vmlinuz: bytes) -> bytes:
    """The ELF kernel inside a bzImage whose payload is xz (Debian's 6.1) or zstd
    (Debian's 6.12)."""
    start = vmlinuz.find(b"\xfd7zXZ\x00")
    if start >= 0:
        decompressor = lzma.LZMADecompressor(format=lzma.FORMAT_XZ)
        elf = decompressor.decompress(vmlinuz[start:])
    else:
        # the payload as the boot protocol's header places it (payload_offset and
        # payload_length, from the protected-mode code), less the 4-byte size appended
        setup_sects = vmlinuz[0x1f1] or 4
        code = (setup_sects + 1) * 512
        offset = int.from_bytes(vmlinuz[0x248:0x24c], "little")
        length = int.from_bytes(vmlinuz[0x24c:0x250], "little")
        payload = vmlinuz[code + offset:code + offset + length - 4]
        if not payload.startswith(b"\x28\xb5\x2f\xfd"):
            raise SystemExit("vmlinuz has neither an xz nor a zstd payload")
        elf = subprocess.run(["zstd", "-dcq"], input=payload, check=True,
                             capture_output=True).stdout
    if not elf.startswith(b"\x7fELF"):
        raise SystemExit("the payload of vmlinuz is not an ELF kernel")
    return elf


def stem(path: pathlib.Path) -> str:
    """A module's name from its file, compressed (.ko.xz) or not."""
    return path.name.removesuffix(".xz").removesuffix(".ko")


@functools.lru_cache(maxsize=None)
def read_module(path: pathlib.Path) -> bytes:
    """A module's ELF bytes: Debian's 6.12 kernels ship them xz-compressed, which the
    image holds decompressed (busybox modprobe loads them as they are)."""
    data = path.read_bytes()
    return lzma.decompress(data) if path.name.endswith(".xz") else data


def module_paths(modroot: pathlib.Path, names: list[str],
                 loaded: list[pathlib.Path] | None = None) -> list[pathlib.Path]:
    """The modules and what they depend on, dependencies first (read from .modinfo),
    leaving out those `loaded` already."""
    index = {stem(p).replace("-", "_"): p for p in modroot.rglob("*.ko*")}
    builtin = {line.rsplit("/", 1)[-1].removesuffix(".ko").replace("-", "_")
               for line in (modroot / "modules.builtin").read_text().split()}
    ordered: list[pathlib.Path] = []

    def visit(name: str) -> None:
        name = name.replace("-", "_")
        if name in builtin or any(stem(p).replace("-", "_") == name
                                  for p in [*(loaded or []), *ordered]):
            return
        path = index.get(name)
        if path is None:
            raise SystemExit(f"kernel module {name} is neither built in nor shipped")
        for dep in filter(None, ",".join(modinfo(path, "depends")).split(",")):
            visit(dep)
        ordered.append(path)

    for name in names:
        visit(name)
    return ordered


def modinfo(path: pathlib.Path, key: str) -> list[str]:
    """The values of `key` in a module's .modinfo strings."""
    data, tag, found = read_module(path), b"\0" + key.encode() + b"=", []
    at = data.find(tag)
    while at >= 0:
        end = data.index(b"\0", at + len(tag))
        found.append(data[at + len(tag):end].decode())
        at = data.find(tag, end)
    return found


def module_tree(modroot: pathlib.Path, shipped: list[pathlib.Path]) -> dict[str, bytes]:
    """The files of /lib/modules/<release> for `shipped` (which holds what each of them
    depends on): the modules at their paths in the kernel's tree, and the modules.dep,
    modules.alias and modules.builtin busybox modprobe reads, to load a list of them in
    one process (/init) or one the kernel asks for (/sbin/modprobe)."""
    rel_of = {stem(p).replace("-", "_"): str(p.relative_to(modroot)) for p in shipped}
    out_rel = {rel: rel.removesuffix(".xz") for rel in rel_of.values()}

    def deps(path: pathlib.Path) -> list[str]:
        """Every module `path` needs, in kmod's order: each before the ones it needs,
        so that modprobe, loading from the end, loads a module's needs first."""
        ordered: list[str] = []

        def visit(module: pathlib.Path) -> None:
            for dep in filter(None, ",".join(modinfo(module, "depends")).split(",")):
                dep_rel = rel_of.get(dep.replace("-", "_"))
                if dep_rel and dep_rel not in ordered:
                    visit(modroot / dep_rel)
                    ordered.append(out_rel[dep_rel])

        visit(path)
        return ordered[::-1]

    files = {out_rel[rel]: unsigned(read_module(modroot / rel)) for rel in rel_of.values()}
    files["modules.dep"] = "".join(
        f"{out_rel[rel_of[name]]}: {' '.join(deps(modroot / rel_of[name]))}".rstrip() + "\n"
        for name in sorted(rel_of)).encode()
    files["modules.alias"] = "".join(
        f"alias {alias} {name}\n" for name in sorted(rel_of)
        for alias in modinfo(modroot / rel_of[name], "alias")).encode()
    files["modules.builtin"] = (modroot / "modules.builtin").read_bytes()
    return files


SIGNATURE_MAGIC = b"~Module signature appended~\n"


def unsigned(module: bytes) -> bytes:
    """A module without its appended signature: the guest kernel cannot check it (the
    VM boots without loading the system's certificates: KERNEL_PARAMS in
    shim/vm/qemu_command.py), and would hash the whole module at each load (under TCG)
    only to find no key."""
    if not module.endswith(SIGNATURE_MAGIC):
        return module
    # struct module_signature (12 bytes) before the magic ends with the signature's size
    info = len(module) - len(SIGNATURE_MAGIC) - 12
    sig_len = int.from_bytes(module[info + 8:info + 12], "big")
    return module[:info - sig_len]


def on_demand_modules(modroot: pathlib.Path) -> list[pathlib.Path]:
    """ON_DEMAND and their dependencies."""
    kernel = modroot / "kernel"
    wanted = sorted({p for pattern in ON_DEMAND for suffix in ("", ".xz")
                     for p in kernel.glob(pattern + suffix)})
    if not wanted:
        raise SystemExit(f"none of the on-demand modules is in {kernel}")
    return module_paths(modroot, [stem(p) for p in wanted])


def module_names(paths: list[pathlib.Path]) -> str:
    """/etc/podvm-modules: the modules /init loads, on one line for `modprobe -a`."""
    return " ".join(stem(p) for p in paths) + "\n"
