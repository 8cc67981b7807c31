"""The shared libraries an ELF file names in its dynamic section (DT_NEEDED), and one of
them dropped: protobuf's C backend (upb) names libstdc++ without using a symbol or a
version of it, and the dynamic loader would map it (2 MiB) at every agent start."""
from __future__ import annotations

import struct

PT_LOAD, PT_DYNAMIC = 1, 2
DT_NULL, DT_NEEDED, DT_STRTAB = 0, 1, 5
_DYN = struct.Struct("<qQ")


class NotElf64(ValueError):
    pass


def _dynamic(data: bytes) -> tuple[int, list[tuple[int, int]], int]:
    """The dynamic section's file offset, its entries up to DT_NULL, and the file offset
    of its string table."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise NotElf64("not a 64-bit little-endian ELF file")
    phoff, = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    loads, dynamic = [], None
    for i in range(phnum):
        p_type, _, p_offset, p_vaddr, _, p_filesz = struct.unpack_from(
            "<IIQQQQ", data, phoff + i * phentsize)
        if p_type == PT_LOAD:
            loads.append((p_vaddr, p_offset, p_filesz))
        elif p_type == PT_DYNAMIC:
            dynamic = (p_offset, p_filesz)
    if dynamic is None:
        raise NotElf64("no dynamic section (a static executable)")
    offset, size = dynamic
    entries = []
    for at in range(offset, offset + size, _DYN.size):
        tag, value = _DYN.unpack_from(data, at)
        if tag == DT_NULL:
            break
        entries.append((tag, value))
    strtab = next(v for t, v in entries if t == DT_STRTAB)
    for vaddr, file_offset, filesz in loads:
        if vaddr <= strtab < vaddr + filesz:
            return offset, entries, strtab - vaddr + file_offset
    raise NotElf64("the string table is in no loaded segment")


def needed(data: bytes) -> list[str]:
    """The libraries `data` (an ELF file) names as DT_NEEDED, in order."""
    _, entries, strtab = _dynamic(data)
    return [data[strtab + value:data.index(b"\0", strtab + value)].decode()
            for tag, value in entries if tag == DT_NEEDED]


def drop_needed(data: bytes, library: str) -> bytes:
    """`data` without its DT_NEEDED entry for `library`: the later entries move up one,
    the freed last one becomes DT_NULL. The name stays in the string table, unused."""
    offset, entries, _ = _dynamic(data)
    names = needed(data)
    if library not in names:
        raise ValueError(f"the ELF file does not need {library} (it needs {names})")
    index = [i for i, (tag, _) in enumerate(entries) if tag == DT_NEEDED][names.index(library)]
    kept = entries[:index] + entries[index + 1:] + [(DT_NULL, 0)]
    out = bytearray(data)
    for i, (tag, value) in enumerate(kept):
        _DYN.pack_into(out, offset + i * _DYN.size, tag, value)
    return bytes(out)
