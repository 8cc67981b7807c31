"""Publishing task events to containerd, in order.

Over ttrpc to containerd's socket (TTRPC_ADDRESS), service
`containerd.services.events.ttrpc.v1.Events`, method `Forward`. When that keeps failing,
the publish binary (`<containerd> --address A publish --topic T --namespace NS`, the
event as a serialized Any on stdin) is the fallback containerd's own shims use.

The queue is bounded (MAX_QUEUED): a guest that makes events faster than containerd
takes them must not grow the shim without bound. When full, the event arriving is
dropped (counted, logged at most every 10 s), never one queued: those came first, and
containerd reads an event in the light of the ones before it (a TaskExit after its
TaskStart); the queue fills only while containerd takes nothing, when the newest is the
least likely to get through anyway. publish() never blocks the loop.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from google.protobuf.any_pb2 import Any
from google.protobuf.message import Message

from podvm_core.ttrpc import ConnectionClosed, TtrpcError

if TYPE_CHECKING:
    from podvm_core.ttrpc import Client

from podvm_core.ratelimit import LimitedLog

log = logging.getLogger("podvm.events")

EVENTS_SERVICE = "containerd.services.events.ttrpc.v1.Events"
_ATTEMPTS = 3
PUBLISH_TIMEOUT = 5.0
MAX_QUEUED = 1024
"""Events waiting to be sent: a pod's normal life queues a handful at a time."""


def pack(event: Message) -> Any:
    """containerd names event types by their bare full name."""
    return Any(type_url=event.DESCRIPTOR.full_name, value=event.SerializeToString())


class Publisher:
    """`publish()` queues; one worker sends in order; `close()` flushes what is queued."""

    def __init__(self, namespace: str, ttrpc_address: str = "", publish_binary: str = "",
                 containerd_address: str = "") -> None:
        self._namespace = namespace
        self._ttrpc_address = ttrpc_address
        self._publish_binary = publish_binary
        self._containerd_address = containerd_address
        self._queue: asyncio.Queue[tuple[str, Any, int] | None] = asyncio.Queue()
        self._client: Client | None = None
        self._dropped = LimitedLog(log)
        self._worker = asyncio.create_task(self._run())

    @property
    def dropped(self) -> int:
        """Events dropped because the queue was full."""
        return self._dropped.count

    def publish(self, topic: str, event: Message) -> None:
        if self._queue.qsize() >= MAX_QUEUED:
            self._dropped.warning("event queue full (%d waiting for containerd): %s dropped",
                                  MAX_QUEUED, topic)
            return
        self._queue.put_nowait((topic, pack(event), time.time_ns()))

    async def close(self, timeout: float = 10) -> None:
        """Send what is queued, for at most `timeout` seconds; the rest is logged as lost."""
        self._queue.put_nowait(None)
        try:
            await asyncio.wait_for(asyncio.shield(self._worker), timeout)
        except TimeoutError:
            log.error("events not published within %ss of exit: %d lost", timeout,
                      self._queue.qsize())
            self._worker.cancel()
            await asyncio.gather(self._worker, return_exceptions=True)
        if self._client is not None:
            await self._client.close()

    async def _run(self) -> None:
        while (item := await self._queue.get()) is not None:
            topic, event, ts = item
            try:
                await self._send(topic, event, ts)
            except Exception:
                log.exception("event %s lost", topic)

    async def _send(self, topic: str, event: Any, ts: int) -> None:
        # At the first event, not before: keeps the daemon's start path short.
        from podvm_core.pb.containerd.services.events.ttrpc.v1.events_pb2 import Envelope, ForwardRequest

        envelope = Envelope(namespace=self._namespace, topic=topic, event=event)
        envelope.timestamp.FromNanoseconds(ts)
        request = ForwardRequest(envelope=envelope)
        error: Exception | None = None
        if self._ttrpc_address:
            for attempt in range(_ATTEMPTS):
                try:
                    client = await self._connected()
                    await client.call_raw(EVENTS_SERVICE, "Forward",
                                          request.SerializeToString(), timeout=5)
                    log.debug("published %s", topic)
                    return
                except (OSError, ConnectionClosed, TtrpcError) as exc:
                    error = exc
                    await self._drop_client()
                    await asyncio.sleep(0.05 * (attempt + 1))
        if not self._publish_binary:
            raise RuntimeError(f"no way to publish {topic}: ttrpc failed ({error}) and there "
                               f"is no -publish-binary")
        log.warning("publishing %s through %s (ttrpc: %s)", topic, self._publish_binary, error)
        await self._publish_with_binary(topic, event)

    async def _connected(self) -> Client:
        if self._client is None:
            # Here, not at the top: the first event, off the daemon's start (issue 47)
            from podvm_core.ttrpc.client import Client

            self._client = await Client.connect(
                self._ttrpc_address, metadata=[("containerd-namespace-ttrpc", self._namespace)])
        return self._client

    async def _drop_client(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            await client.close()

    async def _publish_with_binary(self, topic: str, event: Any) -> None:
        proc = await asyncio.create_subprocess_exec(
            self._publish_binary, "--address", self._containerd_address, "publish",
            "--topic", topic, "--namespace", self._namespace,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE)
        try:
            _, stderr = await asyncio.wait_for(proc.communicate(event.SerializeToString()),
                                               PUBLISH_TIMEOUT)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise RuntimeError(f"{self._publish_binary} publish {topic} did not finish within "
                               f"{PUBLISH_TIMEOUT}s") from None
        if proc.returncode != 0:
            raise RuntimeError(f"{self._publish_binary} publish {topic} exited "
                               f"{proc.returncode}: {stderr.decode(errors='replace').strip()}")
