"""`delete`: containerd runs it, a process of its own that it kills at 5 s, on every
container's way out once the container's daemon is gone or never answered; most often the
daemon has removed everything already. So this module loads what finding that out needs
(the standard library's light parts, podvm's state paths) and the removal's code only
when something is left (shim/host/leftovers.py, cleanup.py); its answer is written by
hand (no protobuf), and an uninstall's collection loads only after an uninstall."""
from __future__ import annotations

import os
import sys
import time

from podvm_core import trees

from ..host import leftovers
from .flags import Flags
from .wire import len_field, varint_field

KILLED = 128 + 9
"""The exit status `delete` reports: killed by SIGKILL, as runc's shim says (a literal:
the signal module would load enum, a tenth of what `delete` imports)."""
SWEEP_UNTIL = 3.0
"""Seconds after its start until which `delete` sweeps the state other sandboxes' killed
`delete`s left (shim/host/cleanup.py, sweep_stale): inside containerd's limit of 5 s."""


def delete(flags: Flags) -> int:
    """Clean up after a container whose daemon is gone (or never answered), from the
    persisted state alone, and print a DeleteResponse (137: killed, as runc's shim says).
    Then sweep what earlier `delete`s that containerd killed left in the namespace."""
    _own_tree_delete(flags.bundle_dir)
    started = time.monotonic()
    bundle = flags.bundle_dir
    if leftovers.left_behind(flags.namespace, flags.id, bundle):
        # Here, not at the top: psutil, cgroups and the network's client, for a pod that
        # left something only.
        from ..host.cleanup import cleanup_container

        cleanup_container(flags.namespace, flags.id, bundle)
    sys.stdout.buffer.write(delete_response(KILLED, time.time_ns()))
    sys.stdout.flush()
    took = time.monotonic() - started
    swept: list[str] = []
    if leftovers.anything_abandoned(flags.namespace):
        from ..host.cleanup import sweep_stale  # as above

        swept = sweep_stale(flags.namespace, time.monotonic() + SWEEP_UNTIL - _since_start())
    _say_done(flags.id, took, swept)
    if trees.own() is not None and trees.retired():
        # Here, not at the top: after an uninstall under this pod only, its tree and what
        # install made go with the pod's last process.
        from podvm_core.treegc import collect_retired_own

        collect_retired_own()
    return 0


def delete_response(exit_status: int, exited_at_ns: int, pid: int = 0) -> bytes:
    """containerd.task.v2.DeleteResponse{pid = 1, exit_status = 2, exited_at = 3 (a
    google.protobuf.Timestamp{seconds = 1, nanos = 2})}, serialized as protobuf does."""
    seconds, nanos = divmod(exited_at_ns, 1_000_000_000)
    exited_at = varint_field(1, seconds) + varint_field(2, nanos)
    return varint_field(1, pid) + varint_field(2, exit_status) + len_field(3, exited_at)


def _own_tree_delete(bundle: str) -> None:
    """A `delete` run from one installed tree for a container another tree's shim started
    (an upgrade came between): exec that tree's shim, which knows its own state; where
    that tree is gone (no process of it was left, so the daemon is gone), this one goes on."""
    own = trees.own()
    try:
        with open(os.path.join(bundle, trees.TREE_FILE)) as f:
            recorded = f.read().strip()
    except OSError:
        return
    if own is None or not recorded or recorded == own or trees.tree_of(recorded) != recorded:
        return
    shim = os.path.join(recorded, "bin", "containerd-shim-podvm-v2")
    if os.path.isfile(shim):
        sys.stdout.flush()
        os.execv(shim, [shim, *sys.argv[1:]])


def _since_start() -> float:
    """Seconds since this process started (containerd's 5 s count from its exec)."""
    with open("/proc/self/stat", "rb") as f:
        ticks = int(f.read().rsplit(b")", 1)[1].split()[19])
    return time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")


def _say_done(ident: str, seconds: float, swept: list[str]) -> None:
    """One logfmt line on stderr, which containerd logs (as "cleanup warnings"): how long
    the cleanup took and how long since this process started, as containerd kills a
    `delete` at 5 s (what it had not removed yet stays, for the next one's sweep)."""
    now = time.time()
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1000):03d}Z"
    said = f"shim delete of {ident} done in {seconds:.3f}s, {_since_start():.3f}s since exec"
    if swept:
        said += (f"; swept the state of {len(swept)} sandboxes whose shim and delete were "
                 f"gone: {', '.join(swept)}")
    sys.stderr.write(f'time="{stamp}" level=info msg="{said}" runtime=io.containerd.podvm.v2\n')
    sys.stderr.flush()
