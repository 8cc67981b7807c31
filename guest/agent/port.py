"""The agent's end of the virtio-serial port QEMU names `podvm.agent`. There is no udev
in the guest: the port is found by its name in sysfs."""
from __future__ import annotations

import asyncio
import logging
import os
from podvm_core.protocol import AGENT_PORT


log = logging.getLogger("podvm.agent")


def find_port(name: str = AGENT_PORT, ports: str = "/sys/class/virtio-ports") -> str:
    # os.listdir, not glob: glob's fnmatch and re cost the agent's start ~70 ms under TCG
    for port in os.listdir(ports) if os.path.isdir(ports) else ():
        try:
            with open(os.path.join(ports, port, "name")) as f:
                if f.read().strip() == name:
                    return "/dev/" + port
        except FileNotFoundError:
            continue
    raise FileNotFoundError(f"no virtio-serial port named {name}")


async def open_port(path: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Stream objects over the character device, as if it were a socket."""
    loop = asyncio.get_running_loop()
    fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    reader = asyncio.StreamReader(limit=8 << 20)
    # The read side owns the descriptor: it is closed when the host hangs up, or the port
    # could not be opened again (a virtio-serial port has one opener: EBUSY).
    read_file = os.fdopen(fd, "rb", buffering=0)
    write_file = os.fdopen(os.dup(fd), "wb", buffering=0)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), read_file)
    transport, protocol = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin,
                                                        write_file)
    writer = asyncio.StreamWriter(transport, protocol, reader, loop)
    return reader, writer


async def wait_for_port(timeout: float = 10.0) -> str:
    deadline = loop_time() + timeout
    while True:
        try:
            return find_port()
        except FileNotFoundError:
            if loop_time() > deadline:
                raise
            await asyncio.sleep(0.01)


def loop_time() -> float:
    return asyncio.get_running_loop().time()
