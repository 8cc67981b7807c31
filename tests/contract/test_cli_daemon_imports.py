"""What the daemon loads before it serves: containerd connects as soon as `start` returns,
so each module it imports first is added to every pod's start (and kept by every idle
daemon). Checked in a fresh interpreter, as the daemon `start` forks has one."""
from __future__ import annotations

import json
import os
import subprocess
import sys

# The daemon's start as shim/contract/cli.py runs it, then the messages its first answers need.
_PROBE = """
import json, sys, time
import shim.contract.cli as cli
cli._import_asyncio_without_tls()
cli._defer_protobuf_python_backend()
import shim.contract.daemon
from google.protobuf.internal import api_implementation
from podvm_core.pb.containerd.task.v2 import shim_pb2
loaded = set(sys.modules)
reply = shim_pb2.ConnectResponse.FromString(
    shim_pb2.ConnectResponse(shim_pid=7, version="v").SerializeToString())
deleted = shim_pb2.DeleteResponse(exit_status=137)
deleted.exited_at.FromNanoseconds(1_500_000_000)
backend = sys.modules["google.protobuf.internal.python_message"]
print(json.dumps({
    "backend": api_implementation.Type(),
    "loaded": sorted(loaded),
    "python_backend_loaded": type(backend) is type(sys),
    "reply": [reply.shim_pid, reply.version],
    "exited_at": deleted.exited_at.seconds,
    "text": str(deleted),
}))
"""


def _probe(**env: str) -> dict:
    result = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                            env={**os.environ, **env}, timeout=60, check=True)
    return json.loads(result.stdout)


def test_the_daemon_serves_without_what_its_first_answers_do_not_use() -> None:
    probe = _probe()
    loaded = set(probe["loaded"])
    assert "ssl" not in loaded  # asyncio's TLS: 4 MB of RSS a shim never uses
    assert "shim.api.task.service" not in loaded  # made at the first call that needs it
    assert "podvm_core.pb.containerd.runtime.sandbox.v1.sandbox_pb2" not in loaded
    # issue 47: the events' client (the first event), an uninstall's collection (shutil),
    # atomic writes' secrets (hmac, hashlib, random): none is a first answer's
    late = {"podvm_core.ttrpc.client", "podvm_core.treegc", "shutil", "secrets", "hashlib",
            "random"}
    assert not late & loaded, sorted(late & loaded)
    if probe["backend"] == "upb":
        # protobuf's pure-Python backend and what it drags in stay unloaded.
        assert not probe["python_backend_loaded"]
        assert not {"google.protobuf.text_format", "pickle"} & loaded
    assert probe["reply"] == [7, "v"]
    assert probe["exited_at"] == 1
    assert "exit_status: 137" in probe["text"]


def test_messages_work_where_protobuf_runs_its_python_backend() -> None:
    """The deferred backend loads at its first use: a node whose protobuf runs it (this
    setting, or no C backend built) gets working messages, only no saving."""
    probe = _probe(PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION="python")
    assert probe["backend"] == "python" and probe["python_backend_loaded"]
    assert probe["reply"] == [7, "v"]
    assert probe["exited_at"] == 1
    assert "exit_status: 137" in probe["text"]
