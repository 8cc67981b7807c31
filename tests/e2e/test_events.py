"""Events the shim publishes reach containerd's subscribers (`ctr events`)."""
from __future__ import annotations

import asyncio
import shutil

from podvm_core.pb.containerd.events.task_pb2 import TaskExit, TaskOOM
from shim.api.events import Publisher


async def published(containerd, publisher: Publisher, topic: str, event, needle: str) -> str:
    """Publish until `ctr events` shows it (the subscription has no ready signal)."""
    proc = await asyncio.create_subprocess_exec(
        "ctr", "--address", containerd.address, "events",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
    assert proc.stdout is not None
    try:
        async with asyncio.timeout(20):
            while True:
                publisher.publish(topic, event)
                try:
                    line = await asyncio.wait_for(proc.stdout.readline(), 0.5)
                except TimeoutError:
                    continue
                while line:
                    text = line.decode()
                    if topic in text and needle in text:
                        return text
                    line = await asyncio.wait_for(proc.stdout.readline(), 0.5)
    finally:
        proc.kill()
        await proc.wait()


async def test_event_forwarded_over_ttrpc(containerd) -> None:
    publisher = Publisher(containerd.namespace, containerd.ttrpc_address)
    try:
        line = await published(containerd, publisher, "/tasks/oom",
                               TaskOOM(container_id="evt-ttrpc"), "evt-ttrpc")
    finally:
        await publisher.close()
    assert containerd.namespace in line


async def test_event_through_the_publish_binary_when_ttrpc_fails(containerd, tmp_path) -> None:
    publisher = Publisher(containerd.namespace, str(tmp_path / "no-such.sock"),
                          publish_binary=shutil.which("containerd") or "containerd",
                          containerd_address=containerd.address)
    event = TaskExit(container_id="evt-bin", id="evt-bin", pid=42, exit_status=7)
    try:
        line = await published(containerd, publisher, "/tasks/exit", event, "evt-bin")
    finally:
        await publisher.close()
    assert '"exit_status":7' in line.replace(" ", "")
