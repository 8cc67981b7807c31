"""Make a Debian binary run from /opt/podvm without the host's /usr: its program
interpreter (the dynamic loader) becomes the bundle's own, and its RUNPATH leads to the
bundle's libraries.

The interpreter is rewritten in place, in the bytes of PT_INTERP: patchelf 0.14
(Debian 12) moves the program headers to grow .interp, and QEMU 7.2's binary so
patched crashes at once (its TLS segment). A path no longer than the one it replaces
needs no move, hence the bundle's short loader name (podvm_node/bundle.py). RUNPATH is
set with patchelf, which handles that dynamic-section change correctly. What to copy is
ldd's answer for the binary as Debian ships it (the whole closure, resolved as the
host's loader would)."""
from __future__ import annotations

import os
import re
import struct
import subprocess

PT_INTERP = 3


class ElfPatchError(ValueError):
    pass


def interpreter_slot(data: bytes) -> tuple[int, int]:
    """(file offset, size with its NUL) of the program interpreter path in `data`."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ElfPatchError("not a 64-bit little-endian ELF file")
    phoff, = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    for i in range(phnum):
        p_type, _, p_offset, _, _, p_filesz = struct.unpack_from(
            "<IIQQQQ", data, phoff + i * phentsize)
        if p_type == PT_INTERP:
            return p_offset, p_filesz
    raise ElfPatchError("no program interpreter (a shared library or static binary)")


def interpreter(data: bytes) -> str:
    offset, size = interpreter_slot(data)
    return data[offset:offset + size].split(b"\0", 1)[0].decode()


def set_interpreter(path: str, loader: str) -> None:
    """Point the executable at `path` to `loader`, in place (NUL-padded)."""
    with open(path, "r+b") as f:
        data = f.read()
        offset, size = interpreter_slot(data)
        raw = loader.encode()
        if len(raw) >= size:
            raise ElfPatchError(f"{path}: interpreter {loader!r} does not fit in "
                                f"{size - 1} bytes")
        f.seek(offset)
        f.write(raw + b"\0" * (size - len(raw)))


def set_runpath(path: str, runpath: str) -> None:
    result = subprocess.run(["patchelf", "--set-rpath", runpath, path],
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise ElfPatchError(f"patchelf --set-rpath {runpath} {path}: {result.stderr.strip()}")


def is_elf(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"\x7fELF"
    except OSError:
        return False


def host_libraries(elf: str, inside: str = "") -> dict[str, str]:
    """soname -> host path of every shared library `elf` loads (ldd: the whole
    closure), less the vDSO and those found inside `inside` (a wheel's own)."""
    out = subprocess.run(["ldd", elf], capture_output=True, text=True)
    if out.returncode != 0:
        raise ElfPatchError(f"ldd {elf}: {out.stderr.strip() or out.stdout.strip()}")
    found = {}
    for line in out.stdout.splitlines():
        m = re.match(r"\s*(\S+) => (\S+) \(", line) or re.match(r"\s*(/\S+) \(", line)
        if not m:
            if "=> not found" in line:
                raise ElfPatchError(f"{elf} needs {line.split()[0]}, not on this machine")
            continue
        name, path = (m.group(1), m.group(2)) if m.lastindex == 2 else \
            (os.path.basename(m.group(1)), m.group(1))
        if not (inside and path.startswith(inside + "/")):
            found[name] = path
    return found
