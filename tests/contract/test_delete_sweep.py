"""A `delete` that containerd killed at its 5 s limit leaves the sandbox's state behind
(issue 30, item 4): the next `delete` in the namespace sweeps it (shim/host/cleanup.py,
sweep_stale), and leaves alone what a live shim, a claim or a `start` still holds."""
from __future__ import annotations

import fcntl
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

from podvm_core.pb.containerd.task.v2 import shim_pb2 as api
from shim.host import cleanup, leftovers, paths
from testbed.shimproc import NS, alive, daemon_pid, make_bundle, run_shim


def wait_gone(pid: int) -> None:
    deadline = time.monotonic() + 10
    while alive(pid):
        assert time.monotonic() < deadline, f"{pid} still alive"
        time.sleep(0.02)


def test_the_next_delete_sweeps_what_a_killed_delete_left(tmp_path) -> None:
    """The daemon killed and its `delete` killed before it removed anything: state
    directory, shim.json and socket stay. Another sandbox's `delete` removes them and
    says so on stderr (containerd's log)."""
    address = str(tmp_path / "containerd.sock")
    bundle = make_bundle(tmp_path, "swept-sb", sandbox_id="swept-sb")
    started = run_shim(bundle, "swept-sb", "start", address)
    assert started.returncode == 0, started.stderr
    socket = started.stdout.decode().removeprefix("unix://")
    pid = daemon_pid(NS, "swept-sb")
    os.kill(pid, signal.SIGKILL)  # as the killed delete did first
    wait_gone(pid)
    state_dir = pathlib.Path(paths.state_dir(NS, "swept-sb"))
    assert (state_dir / "shim.json").exists() and os.path.exists(socket)

    other = make_bundle(tmp_path, "next-sb", sandbox_id="next-sb")
    result = run_shim(other, "next-sb", "delete", address)
    assert result.returncode == 0, result.stderr
    assert api.DeleteResponse.FromString(result.stdout).exit_status == 137
    assert not state_dir.exists() and not os.path.exists(socket)
    said = result.stderr.decode()
    assert "shim delete of next-sb done in" in said and "swept-sb" in said, said


def fake_state(namespace: str, group: str, pid: int | None) -> pathlib.Path:
    state_dir = pathlib.Path(paths.state_dir(namespace, group))
    state_dir.mkdir(parents=True)
    (state_dir / "console.log").write_text("left\n")
    if pid is not None:
        (state_dir / "shim.json").write_text(json.dumps({"pid": pid, "address": None}))
    return state_dir


def test_sweep_keeps_live_shims_claims_and_fresh_starts(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(paths, "STATE_ROOT", str(tmp_path / "run"))
    ns = "sweep"
    gone = subprocess.Popen(["true"])
    gone.wait()
    shim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)",
                             "containerd-shim-podvm-v2"])
    try:
        dead = fake_state(ns, "dead", gone.pid)
        live = fake_state(ns, "live", shim.pid)
        fresh = fake_state(ns, "fresh", None)  # a `start` between mkdir and shim.json
        half = fake_state(ns, "half", None)  # a delete killed inside its rmtree
        os.utime(half, (time.time() - 2 * leftovers.STALE_AFTER,) * 2)
        held = fake_state(ns, "held", gone.pid)  # its own delete is removing it now
        fd = os.open(held, os.O_RDONLY | os.O_DIRECTORY)
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            swept = cleanup.sweep_stale(ns, time.monotonic() + 30)
        finally:
            os.close(fd)
        assert swept == ["dead", "half"]
        assert not dead.exists() and not half.exists()
        assert live.exists() and fresh.exists() and held.exists()
        assert cleanup.sweep_stale(ns, time.monotonic() - 1) == []  # past its deadline
        assert held.exists()
    finally:
        shim.kill()
        shim.wait()
