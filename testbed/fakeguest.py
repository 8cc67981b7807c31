"""The process a FakeVM (testbed/fakevm.py) runs where QEMU would be: one real host
process with QEMU's shape, and a guest agent that answers. Test code only: testbed/ is
never installed on a node (docs/threat-model.md).

What it has of QEMU's, for the host side to act on:
- its threads, named as QEMU names them with debug-threads=on: one "CPU n/TCG" (or
  "CPU n/KVM") per vCPU present, asleep (a vCPU whose guest CPU is offline sleeps too),
  a "call_rcu" and a "worker" thread, and the main thread, which serves the rest; the
  host's cgroup placement and vCPU pinning move and pin these real threads;
- a QMP socket (`--qmp`, the VM's control socket, also the mark on its command line that
  `delete` finds it by: shim/host/cleanup.py) answering the commands the driver's
  shim/vm/qemu/query.py and hotplug.py send, with QEMU's slots: under TCG every vCPU the
  VM may have is present from the start (shim/vm/qemu/command.py), under KVM the free
  slots are hot-plugged (a new thread each); memory in pc-dimms, 8 slots, up to maxmem;
  `stop` and `cont` with QEMU's run states and STOP/RESUME events to every client (a
  test that connects may stop the VM, as an operator would);
- exits as QEMU does: 0 on SIGTERM, on QMP `quit` and on the agent's Shutdown (the guest
  powered off), with everything it ran killed.

The agent (testbed/fakeagent.py) serves podvm's agent protocol on the socket it inherits
(`--agent-fd`, the other end of FakeVM.take_agent_stream()), running each container's
processes as its own children on the host (testbed/fakeprocs.py), in no namespace of
their own: it changes no state of the host (no mount, no cgroup, no network) besides the
processes it runs.

Run as `python -m testbed.fakeguest ARGS` (FakeVM.launch), with an argv[0] of its own
named as QEMU's is (testbed/fakevm.py PROGRAM)."""
from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import os
import signal
import socket
import sys
import threading
import time
from typing import Any

PR_SET_NAME = 15
MIB = 1 << 20
DIMM_SLOTS = 8
"""As QEMU's `-m ...,slots=8` (shim/vm/qemu/command.py)."""
_libc = ctypes.CDLL(None, use_errno=True)


def name_thread(name: str) -> None:
    """The calling thread's name in /proc (comm), as QEMU's debug-threads names it."""
    _libc.prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)


class QmpError(Exception):
    """A command QEMU would refuse: answered as QMP's GenericError."""


class Guest:
    """The VM's hardware as QEMU keeps it: vCPUs (a thread each) and memory."""

    def __init__(self, vcpus: int, max_vcpus: int, memory_mib: int, max_memory_mib: int,
                 accel: str) -> None:
        self.accel = accel
        self.max_vcpus = max(vcpus, max_vcpus)
        self.memory_mib = memory_mib
        self.max_memory_mib = max(max_memory_mib, memory_mib)
        self.online_cpus = vcpus
        """What the guest brought online (the agent's OnlineCPUMem changes it)."""
        self.vcpus: dict[int, int] = {}
        """vCPU index -> host thread id."""
        self.backends: dict[str, int] = {}
        """memory backends (object-add) by id -> bytes."""
        self.dimms: dict[str, int] = {}
        """pc-dimms by id -> bytes (all of them online once the agent is asked)."""
        self.stopping = threading.Event()
        self.run_state = "prelaunch"
        """As QEMU's query-status says it: `cont` runs the VM, `stop` pauses it (a test's
        QMP client may stop it, as an operator would: every client hears STOP)."""
        self.oom = asyncio.Queue()  # type: asyncio.Queue[str]
        """Container ids whose OOM kill the agent's GetOOMEvent reports (x-fake-oom)."""
        self._thread("call_rcu")
        self._thread("worker")  # QEMU's thread pool (block I/O: the root image's)
        # Under TCG every vCPU is there from the start; under KVM only those booted.
        for index in range(self.max_vcpus if accel == "tcg" else vcpus):
            self.add_vcpu(index)

    def _thread(self, name: str) -> int:
        started = threading.Event()
        tid: list[int] = []

        def run() -> None:
            name_thread(name)
            tid.append(threading.get_native_id())
            started.set()
            self.stopping.wait()

        threading.Thread(target=run, name=name, daemon=True).start()
        started.wait()
        return tid[0]

    def add_vcpu(self, index: int) -> int:
        suffix = "TCG" if self.accel == "tcg" else "KVM"
        self.vcpus[index] = self._thread(f"CPU {index}/{suffix}")
        return self.vcpus[index]

    @property
    def memory_bytes(self) -> int:
        return (self.memory_mib << 20) + sum(self.dimms.values())

    def execute(self, command: str, args: dict[str, Any]) -> Any:
        """One QMP command, answered as QEMU 7.2 answers it (the part the driver reads)."""
        if command == "qmp_capabilities":
            return {}
        if command in ("cont", "stop"):
            self.run_state = "running" if command == "cont" else "paused"
            return {}
        if command == "query-status":
            return {"running": self.run_state == "running", "singlestep": False,
                    "status": self.run_state}
        if command == "query-cpus-fast":
            return [{"cpu-index": i, "thread-id": tid, "qom-path": f"/machine/cpu[{i}]",
                     "props": self._props(i), "target": "x86_64"}
                    for i, tid in sorted(self.vcpus.items())]
        if command == "query-iothreads":
            return []
        if command == "query-hotpluggable-cpus":
            return [{"type": "qemu64-x86_64-cpu", "vcpus-count": 1, "props": self._props(i),
                     **({"qom-path": f"/machine/cpu[{i}]"} if i in self.vcpus else {})}
                    for i in range(self.max_vcpus)]
        if command == "query-memory-size-summary":
            return {"base-memory": self.memory_mib << 20,
                    "plugged-memory": sum(self.dimms.values())}
        if command == "query-memory-devices":
            return [{"type": "dimm", "data": {"id": d, "size": size, "slot": n}}
                    for n, (d, size) in enumerate(self.dimms.items())]
        if command == "device_add":
            return self._device_add(args)
        if command == "object-add":
            if args.get("id") in self.backends:
                raise QmpError(f"attempt to add duplicate property '{args.get('id')}'")
            self.backends[args["id"]] = int(args["size"])
            return {}
        if command == "object-del":
            self.backends.pop(args.get("id", ""), None)
            return {}
        if command == "x-fake-oom":  # a test's: the guest's OOM killer struck a container
            self.oom.put_nowait(str(args["container"]))
            return {}
        raise QmpError(f"The command {command} has not been found")

    @staticmethod
    def _props(index: int) -> dict[str, int]:
        return {"socket-id": index, "core-id": 0, "thread-id": 0}

    def _device_add(self, args: dict[str, Any]) -> Any:
        if args.get("driver") == "pc-dimm":
            size = self.backends.get(args.get("memdev", ""))
            if size is None:
                raise QmpError(f"can't find memdev {args.get('memdev')!r}")
            if len(self.dimms) >= DIMM_SLOTS:
                raise QmpError("no free slot for the DIMM (slots=8)")
            if self.memory_bytes + size > self.max_memory_mib << 20:
                raise QmpError("not enough space, currently 0x%x in use of total space "
                               "for memory devices 0x%x" % (
                                   sum(self.dimms.values()),
                                   (self.max_memory_mib - self.memory_mib) << 20))
            self.dimms[args["id"]] = size
            return {}
        index = args.get("socket-id", -1)
        if not args.get("driver", "").endswith("-cpu") or not 0 <= index < self.max_vcpus:
            raise QmpError(f"invalid device {args!r}")
        if index in self.vcpus:
            raise QmpError(f"CPU[{index}] with APIC ID {index} exists")
        self.add_vcpu(index)
        return {}


async def _messages(reader: asyncio.StreamReader):
    """The JSON objects a QMP client sends, one after another with no separator."""
    decoder, text = json.JSONDecoder(), ""
    while chunk := await reader.read(65536):
        text += chunk.decode()
        while text.strip():
            try:
                obj, end = decoder.raw_decode(text.lstrip())
            except ValueError:
                break  # the rest of it is still on its way
            text = text.lstrip()[end:]
            yield obj


async def serve_qmp(guest: Guest, path: str, quit: asyncio.Event) -> asyncio.AbstractServer:
    """QMP on `path`: the greeting, then one JSON object a line each way."""
    sessions: set[asyncio.StreamWriter] = set()

    async def session(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sessions.add(writer)
        writer.write(json.dumps({"QMP": {"version": {"qemu": {
            "major": 7, "minor": 2, "micro": 0}, "package": "(podvm fake)"},
            "capabilities": []}}).encode() + b"\r\n")
        try:
            async for request in _messages(reader):
                reply: dict[str, Any] = {"id": request["id"]} if "id" in request else {}
                command = request.get("execute", "")
                try:
                    reply["return"] = {} if command == "quit" else \
                        guest.execute(command, request.get("arguments", {}))
                except QmpError as exc:
                    reply["error"] = {"class": "GenericError", "desc": str(exc)}
                except (KeyError, TypeError, ValueError) as exc:
                    reply["error"] = {"class": "GenericError", "desc": f"bad arguments: {exc}"}
                writer.write(json.dumps(reply).encode() + b"\r\n")
                if command in ("stop", "cont") and "error" not in reply:
                    _event(sessions, "STOP" if command == "stop" else "RESUME")
                await writer.drain()
                if command == "quit":
                    quit.set()
        except (ConnectionError, ValueError):
            pass
        finally:
            sessions.discard(writer)
            writer.close()

    return await asyncio.start_unix_server(session, path=path)


def _event(sessions: set[asyncio.StreamWriter], name: str) -> None:
    """An event to every QMP client, as QEMU sends them."""
    now = time.time()
    event = {"event": name, "data": {}, "timestamp": {
        "seconds": int(now), "microseconds": int(now % 1 * 1e6)}}
    for writer in list(sessions):
        writer.write(json.dumps(event).encode() + b"\r\n")


async def main(args: argparse.Namespace) -> None:
    # here, not at the top: fakeagent imports this module (run as __main__)
    from .fakeagent import FakeAgent

    from podvm_core.pb.agent import agent_pb2
    from podvm_core.ttrpc import Server, bind

    guest = Guest(args.vcpus, args.max_vcpus, args.memory, args.max_memory, args.accel)
    done = asyncio.Event()
    agent = FakeAgent(guest, done, args.shared_dir)
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, done.set)
    loop.add_signal_handler(signal.SIGINT, done.set)
    reader, writer = await asyncio.open_unix_connection(
        sock=socket.socket(fileno=args.agent_fd))
    server = Server([bind(agent_pb2.DESCRIPTOR.services_by_name["Agent"], agent)])
    serving = asyncio.create_task(server.serve_stream(reader, writer))
    qmp = await serve_qmp(guest, args.qmp, done)  # open last: the VM is up once it answers
    print(f"fake guest of {args.name} up: pid {os.getpid()}, {len(guest.vcpus)} vCPU "
          f"threads, {args.memory} MiB", flush=True)
    await done.wait()
    print(f"fake guest of {args.name}: powering off", flush=True)
    agent.kill_everything()
    qmp.close()
    serving.cancel()
    guest.stopping.set()


def run() -> None:
    parser = argparse.ArgumentParser(prog="qemu-system-podvm-fake")
    parser.add_argument("--name", required=True)
    parser.add_argument("--qmp", required=True)
    parser.add_argument("--agent-fd", type=int, required=True)
    for key in ("vcpus", "max-vcpus", "memory", "max-memory"):
        parser.add_argument(f"--{key}", type=int, required=True)
    parser.add_argument("--accel", default="tcg")
    parser.add_argument("--shared-dir", default="")
    args = parser.parse_args()
    name_thread("qemu-system-x86")
    asyncio.run(main(args))
    sys.stdout.flush()
    os._exit(0)  # the sleeping threads need no goodbye


if __name__ == "__main__":
    run()
