"""CRI PortForward for a VM pod: the host end, in the pod's network namespace.

containerd serves PortForward itself: it enters the pod's namespace on the host and dials
localhost:PORT (tcp4 first, tcp6 if that fails), then copies bytes both ways. With podvm
nothing listens there: the pod's servers run in the guest. So one nat rule in that
namespace sends every TCP connection made to 127.0.0.1 to one listener of the shim,
which reads the port that was asked (SO_ORIGINAL_DST) and has the guest agent connect
to it inside the pod (guest/agent/portforward.py); the bytes travel over the agent's
ttrpc connection, as stdio's do.

The listener is 127.0.0.2:1: the namespace holds nothing but CNI's interfaces and the
taps (the pod's own sockets are in the guest), so no pod can take that address, and the
rule, which matches 127.0.0.1 only, never sends a connection to it back to itself.
::1 is not redirected: containerd tries it only when the tcp4 dial fails, and with the
rule that dial always succeeds; a server in the guest that listens on ::1 only is still
reached, because the agent tries ::1 after 127.0.0.1.

A port nobody listens on in the guest: the host connection is reset, so that
containerd's copy fails and it reports the error to the client (a plain close would
read as an empty, successful forward)."""
from __future__ import annotations

import asyncio
import logging
import socket
import struct
from typing import Protocol

from podvm_core.ttrpc import TtrpcError

from .enter import made_inside
from .errors import NetworkError

log = logging.getLogger("podvm.portforward")

LISTEN_ADDRESS = ("127.0.0.2", 1)
REDIRECTED = "127.0.0.1"
RULE = ("OUTPUT", "-o", "lo", "-d", f"{REDIRECTED}/32", "-p", "tcp", "-j", "DNAT",
        "--to-destination", f"{LISTEN_ADDRESS[0]}:{LISTEN_ADDRESS[1]}")
SO_ORIGINAL_DST = 80
CHUNK = 65536
CLOSE_TIMEOUT = 2


class Guest(Protocol):
    """What the forwarder asks of the guest agent (shim/vm/agent.py's Agent)."""

    async def open_port_forward(self, port: int) -> int: ...
    async def read_port_forward(self, stream_id: int, max_bytes: int) -> bytes: ...
    async def write_port_forward(self, stream_id: int, data: bytes) -> None: ...
    async def close_port_forward(self, stream_id: int, write_only: bool = False) -> None: ...


def original_port(sock: socket.socket) -> int | None:
    """The port a connection redirected by RULE was made to (None: it was not)."""
    raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
    port, address = struct.unpack_from("!H4s", raw, 2)
    if socket.inet_ntoa(address) != REDIRECTED:
        return None
    return port


async def _iptables(netns: str, op: str) -> tuple[int, str]:
    try:
        proc = await asyncio.create_subprocess_exec(
            "nsenter", f"--net={netns}", "iptables", "-w", "-t", "nat", op, *RULE,
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE)
    except OSError as exc:  # no nsenter (util-linux)
        return 127, f"nsenter: {exc.strerror or exc}"
    _, stderr = await proc.communicate()
    return proc.returncode or 0, stderr.decode(errors="replace").strip()


async def add_rule(netns: str) -> None:
    """RULE in the namespace's nat table, once."""
    status, _ = await _iptables(netns, "-C")
    if status == 0:
        return
    status, err = await _iptables(netns, "-A")
    if status != 0:
        raise NetworkError(netns, "add the port-forward rule (iptables)", err or
                           f"exit status {status}")


async def remove_rule(netns: str) -> None:
    """RULE out of the namespace, however often it is there; a namespace (or rule)
    already gone is nothing to do."""
    for _ in range(16):
        status, _ = await _iptables(netns, "-D")
        if status != 0:
            return


def _listen() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(LISTEN_ADDRESS)
        sock.listen(128)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


class PortForwarder:
    """The listener of one pod's namespace and its connections, each carried to the guest."""

    def __init__(self, sandbox_id: str, netns: str, guest: Guest) -> None:
        self.sandbox_id = sandbox_id
        self.netns = netns
        self.guest = guest
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task] = set()

    async def start(self) -> None:
        """The rule and the listener; NetworkError (nothing left behind) if either fails."""
        try:
            sock = made_inside(self.netns, _listen)
        except OSError as exc:
            raise NetworkError(self.netns, f"listen on {LISTEN_ADDRESS[0]}:{LISTEN_ADDRESS[1]}"
                               " for port forwards", exc.strerror or str(exc)) from None
        try:
            await add_rule(self.netns)
            self._server = await asyncio.start_server(self._serve, sock=sock, limit=CHUNK)
        except BaseException:
            sock.close()
            await remove_rule(self.netns)
            raise
        log.info("sandbox %s: port forwards to 127.0.0.1 in %s go to the guest",
                 self.sandbox_id, self.netns)

    async def stop(self) -> None:
        """Listener closed, open forwards ended, rule removed. Idempotent."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
        tasks = list(self._connections)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
            log.info("sandbox %s: %d open port forward(s) ended with the pod",
                     self.sandbox_id, len(tasks))
        if server is not None:
            await remove_rule(self.netns)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            await self._forward(reader, writer)
        except asyncio.CancelledError:  # stop(): the pod goes. Not re-raised: asyncio 3.11
            _reset(writer)              # logs a cancelled connection callback as an error
        except Exception as exc:
            log.error("sandbox %s: port forward failed: %r", self.sandbox_id, exc)
            _reset(writer)
        finally:
            self._connections.discard(task)

    async def _forward(self, reader: asyncio.StreamReader,
                       writer: asyncio.StreamWriter) -> None:
        sock: socket.socket = writer.get_extra_info("socket")
        try:
            port = original_port(sock)
        except OSError as exc:
            port, why = None, exc.strerror
        else:
            why = "not a redirected connection"
        if port is None:
            log.warning("sandbox %s: port forward refused: %s", self.sandbox_id, why)
            _reset(writer)
            return
        try:
            stream_id = await self.guest.open_port_forward(port)
        except TtrpcError as exc:
            log.warning("sandbox %s: port forward to port %d failed: %s", self.sandbox_id,
                        port, exc.message)
            _reset(writer)
            return
        log.info("sandbox %s: port forward %d to port %d opened", self.sandbox_id,
                 stream_id, port)
        directions = [asyncio.create_task(self._to_guest(reader, stream_id)),
                      asyncio.create_task(self._to_host(writer, stream_id))]
        failed: BaseException | None = None
        try:
            done, _ = await asyncio.wait(directions, return_when=asyncio.FIRST_EXCEPTION)
            failed = next((t.exception() for t in done if t.exception() is not None), None)
        except asyncio.CancelledError as exc:
            failed = exc
            raise
        finally:
            for task in directions:
                task.cancel()
            await asyncio.gather(*directions, return_exceptions=True)
            try:
                await asyncio.wait_for(self.guest.close_port_forward(stream_id), CLOSE_TIMEOUT)
            except (TtrpcError, asyncio.TimeoutError):
                pass  # the guest is gone: so is its end
            if failed is None:
                writer.close()
            else:
                _reset(writer)
            log.info("sandbox %s: port forward %d to port %d closed%s", self.sandbox_id,
                     stream_id, port, "" if failed is None else
                     f" ({'the pod stopped' if isinstance(failed, asyncio.CancelledError) else failed})")

    async def _to_guest(self, reader: asyncio.StreamReader, stream_id: int) -> None:
        while data := await reader.read(CHUNK):
            await self.guest.write_port_forward(stream_id, data)
        await self.guest.close_port_forward(stream_id, write_only=True)

    async def _to_host(self, writer: asyncio.StreamWriter, stream_id: int) -> None:
        while data := await self.guest.read_port_forward(stream_id, CHUNK):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof() and not writer.is_closing():
            writer.write_eof()


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with a RST, which the peer reads as an error rather than an end."""
    sock = writer.get_extra_info("socket")
    try:
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    writer.transport.abort()
