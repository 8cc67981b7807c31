"""`start`'s answer to containerd: a BootstrapResult where containerd sent BootstrapParams
(2.3 and later), the bare address where it did not (1.6 to 2.2).

containerd 2.3 writes BootstrapParams to `start`'s stdin and reads a BootstrapResult from
its stdout, both in protobuf's binary encoding (pkg/shim/util.go, core/runtime/v2/shim.go
in containerd; api/runtime/bootstrap/v1/bootstrap.proto, which protos/ has too). It still
takes a bare address, as a legacy shim's, only after the BootstrapResult fails to decode.
Before 2.3 containerd wrote the runtime's options (an Any) or nothing, and reads the
address only. Both are encoded and recognised here by hand, in a few lines of wire
format: `start` loads no protobuf (its start-up time is every pod's)."""
from __future__ import annotations

from .wire import LEN, len_field, read_varint, varint

TASK_VERSION = 2
"""The Task API version podvm answers with: containerd.task.v2, the one containerd 1.6 to
2.2 use with podvm (a bare address means version 2), so 2.3 talks to it as they do."""
PROTOCOL = "ttrpc"


def answer(stdin: bytes, address: str) -> bytes:
    """What `start` writes to stdout: `stdin` is what containerd wrote to its stdin."""
    if sent_params(stdin):
        return result(address)
    return address.encode()


def sent_params(stdin: bytes) -> bool:
    """Whether `stdin` is a BootstrapParams: a message in protobuf's wire format with a
    field above 2 (containerd 2.3 always sets its version, field 4, and its addresses, 5
    to 7). The options alone, as before 2.3, are an Any: fields 1 and 2 only. Anything
    that is not the wire format to its end is not BootstrapParams either."""
    at, high = 0, False
    try:
        while at < len(stdin):
            key, at = read_varint(stdin, at)
            number, wire = key >> 3, key & 7
            if number == 0:
                return False
            high = high or number > 2
            if wire == 0:
                _, at = read_varint(stdin, at)
            elif wire == LEN:
                size, at = read_varint(stdin, at)
                at += size
            elif wire in (1, 5):
                at += 8 if wire == 1 else 4
            else:  # groups (3, 4) and invalid wire types: no message of containerd's
                return False
    except IndexError:
        return False
    return high and at == len(stdin)


def result(address: str, version: int = TASK_VERSION, protocol: str = PROTOCOL) -> bytes:
    """BootstrapResult{version = 1, address = 2, protocol = 3}, serialized."""
    return (b"\x08" + varint(version) + len_field(2, address.encode()) +
            len_field(3, protocol.encode()))
