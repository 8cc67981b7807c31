"""The guest's modules ship without their signatures: the VM boots without the system's
certificates, so the kernel could only hash each module at load to find no key."""
from __future__ import annotations

from guest.kernel import SIGNATURE_MAGIC, unsigned


def test_the_appended_signature_goes_and_the_module_stays() -> None:
    body, signature = b"\x7fELF module body", b"PKCS7" * 10
    info = bytes([0, 0, 2, 0, 0, 0, 0, 0]) + len(signature).to_bytes(4, "big")
    assert unsigned(body + signature + info + SIGNATURE_MAGIC) == body


def test_an_unsigned_module_is_left_as_it_is() -> None:
    assert unsigned(b"\x7fELF module body") == b"\x7fELF module body"
