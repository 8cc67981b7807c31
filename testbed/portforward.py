"""The client side of a CRI streaming server's port-forward (what `crictl port-forward`
and kubelet's clients speak), over websocket: testbed/crictl.py's `port-forward`.

The protocol, as k8s.io/cri-streaming (kubelet's pkg/cri/streaming/portforward,
websocket.go; vendored by containerd) serves it: a websocket to the URL that
PortForward answered, with the ports in the `port` query parameter and the subprotocol
`v4.channel.k8s.io`. Each port i has two channels: data 2*i (both ways) and error
2*i+1 (from the server). Every binary message starts with its channel's number; the
first message of each channel from the server carries only the port, uint16
little-endian. The server forwards one TCP connection per websocket, and a URL serves
one websocket (its token is spent when used): so each local connection gets a new URL
from PortForward and its own websocket. v4 has no way to close one direction: the client's
end of file is not passed on; the server closes the websocket when the pod's side ends
(or fails, after the error message on the error channel)."""
from __future__ import annotations

import asyncio
import struct
import sys
from typing import Awaitable, Callable, TextIO

SUBPROTOCOL = "v4.channel.k8s.io"
DATA, ERROR = 0, 1
CHUNK = 32768


class ProtocolError(Exception):
    """The server did not speak port-forward's websocket protocol as expected."""


def parse_ports(spec: str) -> tuple[int, int]:
    """crictl's `[LOCAL_PORT:]REMOTE_PORT`: (local, remote); local 0 (":80", "0:80") is
    any free port, and no LOCAL_PORT means the remote port's number."""
    local, sep, remote = spec.rpartition(":")
    try:
        remote_port = int(remote)
        local_port = (int(local) if local else 0) if sep else remote_port
    except ValueError:
        raise ValueError(f"invalid port specification {spec!r}: [LOCAL_PORT:]REMOTE_PORT")
    if not 1 <= remote_port <= 65535 or not 0 <= local_port <= 65535:
        raise ValueError(f"invalid port specification {spec!r}: ports are 1-65535")
    return local_port, remote_port


async def forward(new_url: Callable[[], Awaitable[str]], local_port: int, remote_port: int,
                  out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> None:
    """Listen on 127.0.0.1:`local_port` and forward each connection, through a URL that
    `new_url` asks PortForward for, until cancelled."""
    import aiohttp  # only for this command

    async with aiohttp.ClientSession() as session:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                await _one(session, await new_url(), remote_port, reader, writer)
            except Exception as exc:  # noqa: BLE001 - the next connection is served anyway
                print(f"ERRO an error occurred forwarding {local} -> {remote_port}: {exc}",
                      file=err, flush=True)
            finally:
                writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", local_port)
        local = server.sockets[0].getsockname()[1]
        print(f"Forwarding from 127.0.0.1:{local} -> {remote_port}", file=out, flush=True)
        async with server:
            await server.serve_forever()


async def _one(session, url: str, port: int, reader: asyncio.StreamReader,
               writer: asyncio.StreamWriter) -> None:
    import aiohttp

    async with session.ws_connect(url, params={"port": str(port)},
                                  protocols=(SUBPROTOCOL,)) as ws:
        if ws.protocol != SUBPROTOCOL:
            raise ProtocolError(f"the server chose subprotocol {ws.protocol!r}, not "
                                f"{SUBPROTOCOL}")
        prefixed: set[int] = set()
        errors: list[bytes] = []

        async def to_server() -> None:
            while data := await reader.read(CHUNK):
                await ws.send_bytes(bytes([DATA]) + data)

        sending = asyncio.create_task(to_server())
        try:
            async for msg in ws:
                if msg.type != aiohttp.WSMsgType.BINARY:
                    if msg.type == aiohttp.WSMsgType.ERROR:
                        raise ProtocolError(f"websocket error: {ws.exception()}")
                    continue
                frame: bytes = msg.data
                if not frame:
                    continue
                channel, payload = frame[0], frame[1:]
                if channel not in (DATA, ERROR):
                    raise ProtocolError(f"a message on channel {channel}: one port has "
                                        f"channels {DATA} and {ERROR}")
                if channel not in prefixed:  # the channel's first message: its port
                    if len(payload) < 2 or struct.unpack("<H", payload[:2])[0] != port:
                        raise ProtocolError(f"channel {channel} did not open with port "
                                            f"{port}: {payload[:2]!r}")
                    prefixed.add(channel)
                    payload = payload[2:]
                if channel == DATA and payload:
                    writer.write(payload)
                    await writer.drain()
                elif payload:
                    errors.append(payload)
        finally:
            sending.cancel()
            await asyncio.gather(sending, return_exceptions=True)
        if errors:
            raise ProtocolError(b"".join(errors).decode(errors="replace"))
