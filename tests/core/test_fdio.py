"""podvm_core.fdio on real pipes and ptys: what the shim's FIFO copies and the agent's
container stdio rely on."""
from __future__ import annotations

import asyncio
import os
import tty

import pytest

from podvm_core.fdio import FdStream


@pytest.fixture
def pipe():
    r, w = os.pipe()
    reader, writer = FdStream(r), FdStream(w)
    yield reader, writer
    reader.close()
    writer.close()


def watched(fd: int) -> tuple[bool, bool]:
    """Whether the loop has a reader and a writer for `fd` (removing them to look)."""
    loop = asyncio.get_running_loop()
    return loop.remove_reader(fd), loop.remove_writer(fd)


async def test_pipe_round_trip_then_end_of_stream(pipe) -> None:
    reader, writer = pipe
    assert await writer.write(b"hello") == 5
    assert await reader.read() == b"hello"
    writer.close()
    assert await reader.read() == b""


async def test_a_read_waits_for_data(pipe) -> None:
    reader, writer = pipe
    read = asyncio.create_task(reader.read())
    await asyncio.sleep(0.01)
    assert not read.done()
    await writer.write(b"late")
    assert await asyncio.wait_for(read, 5) == b"late"
    assert watched(reader.fd) == (False, False)


async def test_large_write_waits_for_the_reader_and_copies_everything(pipe) -> None:
    reader, writer = pipe
    data = os.urandom(4 << 20)  # far more than a pipe holds
    write = asyncio.create_task(writer.write(data))
    await asyncio.sleep(0.01)
    assert not write.done()
    got = bytearray()
    while len(got) < len(data):
        got += await asyncio.wait_for(reader.read(), 5)
    assert await write == len(data)
    assert bytes(got) == data
    writer.close()
    assert await reader.read() == b""


async def test_read_all_reads_to_end_of_stream(pipe) -> None:
    reader, writer = pipe
    data = os.urandom(1 << 20)

    async def produce() -> None:
        await writer.write(data)
        writer.close()

    got, _ = await asyncio.wait_for(asyncio.gather(reader.read_all(), produce()), 10)
    assert got == data


async def test_close_wakes_a_waiting_read_and_unwatches_the_fd(pipe) -> None:
    reader, _ = pipe
    fd = reader.fd
    read = asyncio.create_task(reader.read())
    await asyncio.sleep(0.01)
    reader.close()
    assert await asyncio.wait_for(read, 5) == b""
    assert reader.fd == -1
    assert watched(fd) == (False, False)
    assert await reader.read() == b""


async def test_close_wakes_a_waiting_write_which_says_how_much_went(pipe) -> None:
    _, writer = pipe
    fd = writer.fd
    data = b"x" * (4 << 20)
    write = asyncio.create_task(writer.write(data))
    await asyncio.sleep(0.01)
    writer.close()
    written = await asyncio.wait_for(write, 5)
    assert 0 < written < len(data)
    assert watched(fd) == (False, False)
    assert await writer.write(b"more") == 0


async def test_close_wakes_several_readers(pipe) -> None:
    reader, writer = pipe
    reads = [asyncio.create_task(reader.read()) for _ in range(3)]
    await asyncio.sleep(0.01)
    await writer.write(b"one")
    await asyncio.sleep(0.01)
    reader.close()
    results = await asyncio.wait_for(asyncio.gather(*reads), 5)
    assert sorted(results) == [b"", b"", b"one"]


async def test_pty_whose_other_side_closed_reads_as_end_of_stream() -> None:
    master, slave = os.openpty()
    pty = FdStream(master)
    try:
        os.write(slave, b"bye\n")
        os.close(slave)  # the container's last process exited
        assert b"bye" in await asyncio.wait_for(pty.read_all(), 5)
        assert await pty.read() == b""
    finally:
        pty.close()


async def test_pty_read_waiting_when_the_other_side_closes_ends() -> None:
    master, slave = os.openpty()
    pty = FdStream(master)
    try:
        read = asyncio.create_task(pty.read())
        await asyncio.sleep(0.01)
        assert not read.done()
        os.close(slave)
        assert await asyncio.wait_for(read, 5) == b""
    finally:
        pty.close()


async def test_close_wakes_a_read_and_a_write_waiting_on_one_pty() -> None:
    master, slave = os.openpty()
    tty.setraw(slave)  # no echo: what the write sends must not come back to the read
    pty = FdStream(master)
    try:
        read = asyncio.create_task(pty.read())
        write = asyncio.create_task(pty.write(b"k" * (1 << 20)))  # nobody reads the slave
        await asyncio.sleep(0.05)
        assert not read.done() and not write.done()
        fd = pty.fd
        pty.close()
        assert await asyncio.wait_for(read, 5) == b""
        assert await asyncio.wait_for(write, 5) < 1 << 20
        assert watched(fd) == (False, False)
    finally:
        pty.close()
        os.close(slave)
