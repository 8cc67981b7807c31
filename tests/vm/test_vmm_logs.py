"""What QEMU and virtiofsd write to their stdout and stderr is kept at a bounded size
(shim/vm/vmmlog.py): a VMM a guest makes write without end costs the node a file of at
most the cap in /run, which still ends with the VMM's last words, quoted in the error."""
from __future__ import annotations

import pathlib
import sys

import pytest

from shim.vm import virtiofsd
from shim.vm.hypervisor import HypervisorError, VMExited
from shim.vm.qemu.driver import QemuVM
from tests.vm.test_qemu import spec

CAP = 256 << 10
FLOOD = 8 << 20  # 32 times the cap


def flooder(tmp_path: pathlib.Path, name: str, last_words: str, status: int) -> str:
    """A VMM stand-in that writes FLOOD bytes of numbered lines to stdout and stderr, then
    `last_words` to stderr, and exits with `status` (`--print-capabilities` answered
    with nothing, as a daemon that has no such option)."""
    script = tmp_path / name
    script.write_text(f"""#!{sys.executable}
import os, sys
if "--print-capabilities" in sys.argv:
    sys.exit(0)
line = 0
written = 0
while written < {FLOOD}:
    batch = b"".join(b"warning %08d: a guest's request refused\\n" % (line + i)
                     for i in range(1000))
    os.write(1 + line // 1000 % 2, batch)
    written += len(batch)
    line += 1000
os.write(2, b"{last_words}\\n")
sys.exit({status})
""")
    script.chmod(0o755)
    return str(script)


def assert_capped(log: pathlib.Path, last_words: str) -> None:
    from shim.vm.vmmlog import LOG_MAX_BYTES
    assert LOG_MAX_BYTES == CAP
    data = log.read_bytes()
    assert CAP // 2 <= len(data) <= CAP, len(data)
    assert data.endswith(f"{last_words}\n".encode())


async def test_a_qemu_that_writes_without_end_leaves_a_log_no_bigger_than_the_cap(
        tmp_path) -> None:
    qemu = flooder(tmp_path, "qemu-system-x86_64", "qemu: the last word", 1)
    vm = QemuVM(spec(tmp_path, path=qemu, enable_jail=False, shared_fs="virtio-9p"))
    with pytest.raises(VMExited) as err:
        await vm.launch()
    log = tmp_path / "vm" / "qemu.log"
    assert log.stat().st_size <= CAP, f"{log.stat().st_size} bytes of QEMU's output kept"
    assert "exited with status 1" in str(err.value)
    assert "qemu: the last word" in str(err.value)  # the newest kept, and quoted
    assert_capped(log, "qemu: the last word")


async def test_a_virtiofsd_that_writes_without_end_leaves_a_log_no_bigger_than_the_cap(
        tmp_path) -> None:
    daemon = flooder(tmp_path, "virtiofsd", "virtiofsd: the last word", 3)
    server = virtiofsd.FileServer(spec(tmp_path, virtio_fs_daemon=daemon))
    (tmp_path / "vm").mkdir()  # QemuVM.launch makes it
    with pytest.raises(HypervisorError, match="exited with status 3: .*virtiofsd: the last"):
        await server.start(None)
    log = tmp_path / "vm" / "virtiofsd.log"
    assert log.stat().st_size <= CAP, f"{log.stat().st_size} bytes of virtiofsd's output kept"
    assert_capped(log, "virtiofsd: the last word")
