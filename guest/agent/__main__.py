"""Run the agent: PID 1 of the guest after /init. Logs go to the serial console.

/init starts it with `python3 -c "from podvm_agent.__main__ import run; run()"`, not
`-m podvm_agent`: runpy and what it imports cost ~50 ms under TCG before anything serves."""
from __future__ import annotations

import sys

from .lazy import defer

sys.modules["ssl"] = None  # type: ignore[assignment]  # no TLS in the guest: asyncio skips it
# Imported by traceback and linecache (through logging and asyncio), used by neither
# unless a traceback is printed; calendar by protobuf's well_known_types, for a
# Timestamp made from a datetime only.
defer("tokenize", "textwrap", "calendar")


def _defer_python_message() -> None:
    """With the upb (C) protobuf backend, descriptor_pool and builder still import the
    pure-Python message implementation (and through it text_format, decoder, encoder,
    containers...) without using it: ~0.1 s under TCG. Load it only if it is used."""
    # Before protobuf's other modules load (they are what this defers), so not above.
    from google.protobuf.internal import api_implementation

    if api_implementation.Type() == "upb":
        defer("google.protobuf.internal.python_message")


_defer_python_message()

import asyncio  # noqa: E402
import logging  # noqa: E402
import time  # noqa: E402

from podvm_core.pb.agent import agent_pb2  # noqa: E402
from podvm_core.ttrpc import Server, bind  # noqa: E402

from . import holder  # noqa: E402
from .port import open_port, wait_for_port  # noqa: E402
from .reaper import REAPER  # noqa: E402
from .service import AgentService  # noqa: E402

log = logging.getLogger("podvm.agent")


async def main() -> None:
    REAPER.install()
    service = AgentService()
    server = Server([bind(agent_pb2.DESCRIPTOR.services_by_name["Agent"], service)])
    # Both before the port opens: a template is saved as it opens, with this holder in it
    path, _ = await asyncio.gather(wait_for_port(), holder.prepare())
    log.info("serving podvm.agent.v1.Agent on %s, %.2fs after boot", path, time.monotonic())
    while True:
        reader, writer = await open_port(path)
        await server.serve_stream(reader, writer)
        log.info("host closed the agent port; serving it again")
        await asyncio.sleep(0.05)


def run() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                        format="podvm-agent: %(levelname)s %(message)s")
    asyncio.run(main())


if __name__ == "__main__":
    run()
