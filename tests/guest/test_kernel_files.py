"""The guest kernel's files as Debian packs them, read by the image builder
(guest/kernel.py): the ELF kernel out of a bzImage whose payload is zstd (the backported
6.12) or xz (bookworm's 6.1), found through the boot protocol's header, and modules
compressed (.ko.xz) or not, named and read alike."""
from __future__ import annotations

import lzma
import pathlib
import subprocess

import pytest

from guest.kernel import extract_vmlinux, modinfo, read_module, stem
from tests.conftest import require_tool

ELF = b"\x7fELF" + bytes(range(256)) * 64


def bzimage(payload: bytes, setup_sects: int = 3, offset: int = 0x1234) -> bytes:
    """A bzImage's layout as far as the builder reads it: the setup sectors, then the
    protected-mode code with the payload at payload_offset, its length at
    payload_length, the decompressed size appended after it."""
    code = (setup_sects + 1) * 512
    image = bytearray(code + offset)
    image[0x1f1] = setup_sects
    image[0x248:0x24c] = offset.to_bytes(4, "little")
    image[0x24c:0x250] = (len(payload) + 4).to_bytes(4, "little")
    return bytes(image) + payload + len(ELF).to_bytes(4, "little") + b"\0" * 512


def test_a_zstd_payload_found_through_the_header() -> None:
    zstd = require_tool("zstd", "zstd")
    packed = subprocess.run([zstd, "-q", "-c"], input=ELF, capture_output=True,
                            check=True).stdout
    assert extract_vmlinux(bzimage(packed)) == ELF


def test_an_xz_payload() -> None:
    assert extract_vmlinux(bzimage(lzma.compress(ELF))) == ELF


def test_a_payload_that_is_neither_is_refused() -> None:
    with pytest.raises(SystemExit, match="neither an xz nor a zstd payload"):
        extract_vmlinux(bzimage(b"gzip?" * 100))


def test_modules_compressed_or_not_are_named_and_read_alike(tmp_path) -> None:
    body = b"\x7fELF" + b"\0depends=virtio,virtio_ring\0alias=fs-virtiofs\0"
    plain, packed = tmp_path / "a-b.ko", tmp_path / "a-b.ko.xz"
    plain.write_bytes(body)
    packed.write_bytes(lzma.compress(body))
    assert stem(plain) == stem(packed) == "a-b"
    assert read_module(plain) == read_module(packed) == body
    assert modinfo(packed, "depends") == ["virtio,virtio_ring"]
    assert modinfo(pathlib.Path(packed), "alias") == ["fs-virtiofs"]
