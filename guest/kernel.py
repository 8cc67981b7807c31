"""The guest's kernel from its Debian package: the uncompressed vmlinux QEMU boots, and
the kernel modules the guest gets (which ones, what they depend on, and the files busybox
modprobe reads to load them)."""
from __future__ import annotations

import lzma
import pathlib

# What the initramfs loads to mount the root image (their dependencies come with them
# through module_paths; crc32c_generic is libcrc32c's soft dependency, which .modinfo
# names by alias only).
ROOT_MODULES = ["virtio_pci", "virtio_pmem", "nd_pmem", "crc32c_generic", "erofs"]
# What the root's /init loads from the image: virtiofs (or 9p) for the pod's share
# (shim/config.py's shared_fs), virtio_net for the pod's interfaces,
# virtio_balloon to hand the pages the guest frees back to the host, virtio_blk, ext4
# and overlay for the containers' writable layers on the pod's scratch disk
# (guest/agent/writable.py), quota_v2 for its project quotas (guest/agent/quota.py: ext4
# keeps them in hidden inodes, in that format, and mounts nothing with quotas without it).
MODULES = ["virtio_console", "virtiofs", "9pnet_virtio", "9p", "virtio_net", "virtio_balloon",
           "virtio_blk", "ext4", "quota_v2", "overlay"]
# Loaded on demand, as on a node: what a privileged container (or one with NET_ADMIN or
# SYS_ADMIN) can use under runc and would miss in the guest: bridges, netfilter (nft and
# iptables), tun, fuse, veth, dummy, VLAN, macvlan, ipvlan, vxlan. Paths under
# the kernel's module tree, globs allowed; what they depend on comes with them. They sit
# in the shared root image, so a pod pays for one only when it loads it.
ON_DEMAND = ["net/bridge/*.ko", "net/netfilter/*.ko", "net/netfilter/ipset/*.ko",
             "net/netfilter/ipvs/*.ko", "net/ipv4/netfilter/*.ko",
             "net/ipv6/netfilter/*.ko", "net/bridge/netfilter/*.ko", "net/8021q/*.ko",
             "drivers/net/tun.ko", "drivers/net/veth.ko", "drivers/net/dummy.ko",
             "drivers/net/macvlan.ko", "drivers/net/ipvlan/*.ko", "drivers/net/vxlan/*.ko",
             "fs/fuse/*.ko",
             # the text search conntrack helpers ask for by name (amanda, ...)
             "lib/ts_*.ko"]


def extract_vmlinux(vmlinuz: bytes) -> bytes:
    """The ELF kernel inside a bzImage whose payload is xz."""
    start = vmlinuz.find(b"\xfd7zXZ\x00")
    if start < 0:
        raise SystemExit("vmlinuz has no xz payload")
    decompressor = lzma.LZMADecompressor(format=lzma.FORMAT_XZ)
    elf = decompressor.decompress(vmlinuz[start:])
    if not elf.startswith(b"\x7fELF"):
        raise SystemExit("the xz payload of vmlinuz is not an ELF kernel")
    return elf


def module_paths(modroot: pathlib.Path, names: list[str],
                 loaded: list[pathlib.Path] | None = None) -> list[pathlib.Path]:
    """The modules and what they depend on, dependencies first (read from .modinfo),
    leaving out those `loaded` already."""
    index = {p.name.removesuffix(".ko").replace("-", "_"): p for p in modroot.rglob("*.ko")}
    builtin = {line.rsplit("/", 1)[-1].removesuffix(".ko").replace("-", "_")
               for line in (modroot / "modules.builtin").read_text().split()}
    ordered: list[pathlib.Path] = []

    def visit(name: str) -> None:
        name = name.replace("-", "_")
        if name in builtin or any(p.name.removesuffix(".ko").replace("-", "_") == name
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
    data, tag, found = path.read_bytes(), b"\0" + key.encode() + b"=", []
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
    rel_of = {p.name.removesuffix(".ko").replace("-", "_"): str(p.relative_to(modroot))
              for p in shipped}

    def deps(path: pathlib.Path) -> list[str]:
        """Every module `path` needs, in kmod's order: each before the ones it needs,
        so that modprobe, loading from the end, loads a module's needs first."""
        ordered: list[str] = []

        def visit(module: pathlib.Path) -> None:
            for dep in filter(None, ",".join(modinfo(module, "depends")).split(",")):
                dep_rel = rel_of.get(dep.replace("-", "_"))
                if dep_rel and dep_rel not in ordered:
                    visit(modroot / dep_rel)
                    ordered.append(dep_rel)

        visit(path)
        return ordered[::-1]

    files = {rel: unsigned((modroot / rel).read_bytes()) for rel in rel_of.values()}
    files["modules.dep"] = "".join(
        f"{rel_of[name]}: {' '.join(deps(modroot / rel_of[name]))}".rstrip() + "\n"
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
    shim/vm/qemu/command.py), and would hash the whole module at each load (under TCG)
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
    wanted = sorted({p for pattern in ON_DEMAND for p in kernel.glob(pattern)})
    if not wanted:
        raise SystemExit(f"none of the on-demand modules is in {kernel}")
    return module_paths(modroot, [p.name.removesuffix(".ko") for p in wanted])


def module_names(paths: list[pathlib.Path]) -> str:
    """/etc/podvm-modules: the modules /init loads, on one line for `modprobe -a`."""
    return " ".join(p.name.removesuffix(".ko") for p in paths) + "\n"
