"""`python -m podvm_node.rust_virtiofsd --out DIR`: the Rust virtiofsd that podvm ships,
DIR/virtiofsd. `make install` puts it in /opt/podvm/libexec and the node bundle carries it
there (podvm_node/bundle.py); it is the pods' file server by default (shim/config.py),
Debian 12's node included, whose own daemon is QEMU 7.2's C one: that one keeps a
descriptor on its /proc through which a guest that takes it over reaches
/proc/sys/kernel/core_pattern as root (tests/vm/test_virtiofsd_jail.py), and QEMU 8.0
dropped it. The tests serve pods with the same file (testbed/vmconfig.py).

It is Debian 13's package, fetched through an apt state of this build's own (DIR/apt: its
lists and Debian's archive keyring, so that apt checks what it fetches; the host's apt
configuration is left alone). It needs glibc 2.39 for two calls alone, pidfd_spawnp and
pidfd_getpid, weak references that Rust's standard library looks up and does without:
that need is marked weak (weaken_version), so Debian 12's glibc 2.36 loads it. Fetched
again only when Debian's version changes (DIR/VERSION: security updates come through
Debian's lists); the last one serves when the mirror cannot be reached."""
from __future__ import annotations

import argparse
import os
import pathlib
import struct
import subprocess
import sys
import tempfile

PACKAGE = "virtiofsd"
SOURCE = ("deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] "
          "http://deb.debian.org/debian trixie main")
BINARY = "usr/libexec/virtiofsd"
WEAK = ("GLIBC_2.39",)
"""The glibc versions whose calls the binary does without (checked: weak references)."""
SHT_DYNSYM, SHT_GNU_VERNEED, SHT_GNU_VERSYM = 11, 0x6ffffffe, 0x6fffffff
VER_FLG_WEAK = 0x2
STB_WEAK = 2


class WeakenError(ValueError):
    pass


def weaken_version(path: str, version: str) -> list[str]:
    """Mark the executable's need of symbol version `version` weak, in place, so that a
    library without that version still loads it: refused unless every symbol bound to
    it is a weak reference (one the program looks up and does without). Their names."""
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        sections = _sections(data)
        if SHT_GNU_VERNEED not in sections:
            raise WeakenError(f"{path}: no version needs")
        offset, _, strtab, count = sections[SHT_GNU_VERNEED]
        slots = {}
        for _ in range(count):
            _, n_aux, _, aux, next_need = struct.unpack_from("<HHIII", data, offset)
            at = offset + aux
            for _ in range(n_aux):
                _, flags, index, name, next_aux = struct.unpack_from("<IHHII", data, at)
                if _string(data, strtab + name) == version:
                    slots[at + 4] = (flags, index)
                at += next_aux
            offset += next_need
        if not slots:
            raise WeakenError(f"{path} does not need version {version}")
        symbols = _symbols_of(data, sections, {index for _, index in slots.values()})
        strong = [name for name, bind in symbols if bind != STB_WEAK]
        if strong:
            raise WeakenError(f"{path} needs {', '.join(strong)} of {version}: not weak "
                              f"references, the program cannot run without them")
        for at, (flags, _) in slots.items():
            struct.pack_into("<H", data, at, flags | VER_FLG_WEAK)
        f.seek(0)
        f.write(data)
    return sorted(name for name, _ in symbols)


def _sections(data: bytes) -> dict[int, tuple[int, int, int, int]]:
    """sh_type -> (offset, size, offset of its linked section, info) of the first
    section of each type."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise WeakenError("not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize)
               for i in range(shnum)]
    found: dict[int, tuple[int, int, int, int]] = {}
    for _, sh_type, _, _, offset, size, link, info, _, _ in headers:
        found.setdefault(sh_type, (offset, size, headers[link][4], info))
    return found


def _symbols_of(data: bytes, sections: dict, indexes: set[int]) -> list[tuple[str, int]]:
    """(name, binding) of the dynamic symbols whose version is one of `indexes`."""
    symtab, size, names, _ = sections[SHT_DYNSYM]
    versym = sections[SHT_GNU_VERSYM][0]
    found = []
    for i in range(size // 24):
        index, = struct.unpack_from("<H", data, versym + 2 * i)
        if index & 0x7fff in indexes:
            name, info = struct.unpack_from("<IB", data, symtab + 24 * i)
            found.append((_string(data, names + name), info >> 4))
    return found


def _string(data: bytes, at: int) -> str:
    return data[at:data.index(0, at)].decode()


class DebianApt:
    """apt with SOURCE's lists under `root`, the host's dpkg status and keyrings."""

    def __init__(self, root: pathlib.Path) -> None:
        self.root = root = root.resolve()
        for d in ("lists/partial", "archives/partial", "cache"):
            (root / d).mkdir(parents=True, exist_ok=True)
        (root / "sources.list").write_text(SOURCE + "\n")
        settings = {"Dir::Etc::SourceList": root / "sources.list",
                    "Dir::Etc::SourceParts": "/dev/null",
                    "Dir::Etc::PreferencesParts": "/dev/null",
                    "Dir::State::Lists": root / "lists",
                    "Dir::Cache": root / "cache", "Dir::Cache::Archives": root / "archives"}
        (root / "apt.conf").write_text("".join(f'{k} "{v}";\n' for k, v in settings.items()))
        self.env = dict(os.environ, APT_CONFIG=str(root / "apt.conf"))

    def run(self, *cmd: str, cwd: str | None = None) -> str:
        return subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=cwd,
                              env=self.env).stdout

    def candidate(self) -> str:
        """The version apt would fetch, from lists refreshed now (security updates come
        there); "" when there are none."""
        try:
            self.run("apt-get", "update", "-q")
        except subprocess.CalledProcessError as exc:
            print(f"warning: {SOURCE}: lists not refreshed: {exc.stderr.strip()[-300:]}",
                  file=sys.stderr)
        try:
            policy = self.run("apt-cache", "policy", PACKAGE)
        except subprocess.CalledProcessError:
            return ""
        for line in policy.splitlines():
            if line.strip().startswith("Candidate:"):
                version = line.split(":", 1)[1].strip()
                return "" if version == "(none)" else version
        return ""


def build(out: pathlib.Path) -> str:
    """out/virtiofsd, Debian 13's at apt's candidate version, runnable here; what it is."""
    apt = DebianApt(out / "apt")
    version = apt.candidate()
    have = (out / "VERSION").read_text().strip() if (out / "VERSION").exists() else ""
    if not version:
        if have:
            return f"{PACKAGE} {have} (kept: {SOURCE} cannot be read)"
        raise SystemExit(f"cannot resolve {PACKAGE} from {SOURCE}")
    if version == have and (out / PACKAGE).exists():
        return f"{PACKAGE} {version} (up to date)"
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        work = pathlib.Path(tmp)
        apt.run("apt-get", "download", "-q", f"{PACKAGE}={version}", cwd=str(work))
        deb, = work.glob("*.deb")
        subprocess.run(["dpkg-deb", "-x", str(deb), str(work / "root")], check=True)
        binary = work / "root" / BINARY
        weakened = [name for v in WEAK for name in weaken_version(str(binary), v)]
        said = subprocess.run([str(binary), "--version"], capture_output=True, text=True)
        if said.returncode != 0:
            raise SystemExit(f"{PACKAGE} {version} does not run here: {said.stderr.strip()}")
        os.replace(binary, out / PACKAGE)
        (out / "VERSION").write_text(version + "\n")
    return f"{PACKAGE} {version} (weak: {', '.join(weakened)})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=pathlib.Path)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"{build(args.out)} in {args.out}")


if __name__ == "__main__":
    main()
