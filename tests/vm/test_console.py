"""The guest's console on the host (shim/vm/qemu/console.py, its file a
shim/vm/cappedlog.py): a guest that writes it without end costs a file of at most
console_log_max_kib, which keeps the newest output; on a real QEMU, booted and restored
from a template, the log shows what the guest said and stays within its cap while the
guest floods it."""
from __future__ import annotations

import asyncio
import os
import pathlib
import shutil

import pytest

from podvm_core.ttrpc import TtrpcError
from shim import config
from shim.vm.agent import Agent
from shim.vm.cappedlog import CappedLog
from shim.vm.qemu.console import ConsoleLog
from shim.vm.qemu.driver import QemuVM
from shim.vm.template import template as templates
from tests.vm.test_qemu import spec as boot_spec
from tests.vm.test_template import vm_spec as template_spec

LINE = 9  # "%08d\n"


class EndlessGuest:
    """QEMU's end of the console socket, with a guest writing numbered lines to it until
    told to stop (or `total` lines), as fast as the reader takes them."""

    def __init__(self, path: str, total: int) -> None:
        self.path, self.total = path, total
        self.written = 0
        self.done = asyncio.Event()

    async def __aenter__(self) -> "EndlessGuest":
        async def write(reader, writer) -> None:
            try:
                while self.written < self.total:
                    batch = b"".join(b"%08d\n" % (self.written + i) for i in range(1000))
                    writer.write(batch)
                    await writer.drain()
                    self.written += 1000
            finally:
                writer.close()
                self.done.set()

        self._server = await asyncio.start_unix_server(write, path=self.path)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._server.close()


def suffix_of_the_stream(data: bytes) -> list[int]:
    """The numbers of the whole lines in `data`, checked to follow one another."""
    lines = data.split(b"\n")
    assert lines[-1] == b""  # ends with a whole line: the newest
    numbers = [int(line) for line in lines[1:-1]]  # the first may be cut
    assert numbers == list(range(numbers[0], numbers[0] + len(numbers)))
    return numbers


async def test_an_endless_console_stays_within_its_cap_and_keeps_the_newest(tmp_path) -> None:
    cap = 16 << 10
    log = tmp_path / "console.log"
    async with EndlessGuest(str(tmp_path / "console.sock"), total=500_000) as guest:
        console = await ConsoleLog.attach(guest.path, str(log), cap)
        sizes = []
        while not guest.done.is_set():
            sizes.append(log.stat().st_size)
            await asyncio.sleep(0.005)
        await console.finished(grace=5)
        await console.close()
    assert guest.written == 500_000  # 4.5 MB through, the reader never held it up
    assert sizes and max(sizes) <= cap
    data = log.read_bytes()
    assert cap // 2 <= len(data) <= cap
    numbers = suffix_of_the_stream(data)
    assert numbers[-1] == guest.written - 1
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


async def test_a_chunk_larger_than_the_cap_keeps_its_newest_bytes(tmp_path) -> None:
    log = CappedLog(str(tmp_path / "console.log"), 100)
    log.write(b"a" * 60)
    log.write(b"b" * 30)
    assert (tmp_path / "console.log").read_bytes() == b"a" * 60 + b"b" * 30
    log.write(b"c" * 20)  # over: the newest half of the cap kept
    assert (tmp_path / "console.log").read_bytes() == b"b" * 30 + b"c" * 20
    log.write(bytes(range(250)))
    assert (tmp_path / "console.log").read_bytes() == bytes(range(150, 250))


async def test_a_log_that_cannot_be_written_still_drains_the_console(tmp_path) -> None:
    """Its directory removed under it (the pod's teardown): the guest is not held up."""
    vm_dir = tmp_path / "vm"
    vm_dir.mkdir()
    async with EndlessGuest(str(tmp_path / "console.sock"), total=200_000) as guest:
        console = await ConsoleLog.attach(guest.path, str(vm_dir / "console.log"), 4096)
        shutil.rmtree(vm_dir)
        await asyncio.wait_for(guest.done.wait(), 30)
        await console.close()
    assert guest.written == 200_000


@pytest.mark.parametrize("value", [0, -1, config.CONSOLE_LOG_MAX_KIB + 1])
def test_a_cap_that_keeps_nothing_or_fills_run_is_refused(tmp_path, value) -> None:
    f = tmp_path / "c.toml"
    f.write_text(f"[hypervisor.qemu]\nconsole_log_max_kib = {value}\n")
    with pytest.raises(config.ConfigError) as err:
        config.load(str(f))
    assert "console_log_max_kib must be 1 to" in str(err.value) and str(f) in str(err.value)


async def flood(agent: Agent, lines: int) -> None:
    """The guest writes its console: each refused call is a line the agent logs there."""
    for i in range(lines):
        with pytest.raises(TtrpcError):
            await agent.open_port_forward(70000 + i)


async def test_a_real_guest_flooding_its_console_is_capped_with_its_last_words(tmp_path) -> None:
    vm = QemuVM(boot_spec(tmp_path, console_log_max_kib=4))
    await vm.launch()
    try:
        agent = Agent.of_vm(vm)
        await agent.ping(timeout=30)
        assert b"podvm-init: starting the agent" in open(vm.console_log, "rb").read()
        await flood(agent, 100)  # ~100 bytes a line: more than twice the cap
        await agent.ping()  # its last line was written before this answer
        await asyncio.sleep(0.5)
        data = open(vm.console_log, "rb").read()
        assert 2048 <= len(data) <= 4096
        assert b"port 70099 is not a TCP port" in data  # the newest line is kept
        assert b"port 70000 " not in data and b"podvm-init" not in data  # the oldest gone
        await agent.close()
    finally:
        await vm.stop()
    assert not os.path.exists(vm.console_socket)
    assert os.path.getsize(vm.console_log) <= 4096  # the file stays for error messages


async def test_a_guest_restored_from_a_template_has_its_console_read(tmp_path) -> None:
    maker = template_spec(tmp_path, "maker")
    template = templates.of(maker)
    await template.make(maker, None)
    vm = QemuVM(template_spec(tmp_path, "pod", template=True))
    await vm.launch(restore_from=template.saved())
    try:
        agent = Agent.of_vm(vm)
        await agent.resume_restored({}, timeout=30)
        await agent.ping(timeout=30)
        await asyncio.sleep(0.5)
        log = pathlib.Path(vm.console_log).read_bytes()
        assert b"resumed from a template" in log, log[-1000:]
        await agent.close()
    finally:
        await vm.stop()
