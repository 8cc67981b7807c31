"""Run the agent: PID 1 of the guest after /init. Logs go to the serial console."""
from __future__ import annotations

import sys

sys.modules["ssl"] = None  # type: ignore[assignment]  # no TLS in the guest: asyncio skips it
import asyncio  # noqa: E402
import logging  # noqa: E402
import time  # noqa: E402

from shim.pb.agent import agent_pb2  # noqa: E402
from shim.ttrpc import Server, bind  # noqa: E402

from .port import open_port, wait_for_port  # noqa: E402
from .reaper import REAPER  # noqa: E402
from .service import AgentService  # noqa: E402

log = logging.getLogger("podvm.agent")


async def main() -> None:
    REAPER.install()
    service = AgentService()
    server = Server([bind(agent_pb2.DESCRIPTOR.services_by_name["Agent"], service)])
    oom = asyncio.create_task(service.watch_oom())
    path = await wait_for_port()
    log.info("serving podvm.agent.v1.Agent on %s, %.2fs after boot", path, time.monotonic())
    while True:
        reader, writer = await open_port(path)
        await server.serve_stream(reader, writer)
        log.info("host closed the agent port; serving it again")
        await asyncio.sleep(0.05)
    oom.cancel()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                        format="podvm-agent: %(levelname)s %(message)s")
    asyncio.run(main())
