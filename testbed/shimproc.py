"""The harness tests and benchmarks share: the real shim binary run the way containerd
runs it."""
from __future__ import annotations

import asyncio
import json
import os
import pathlib
import subprocess
import sys
import time

from podvm_core.treegc import WORKER_PARENT

from .namespaces import run_namespace

SHIM = str(pathlib.Path(sys.executable).parent / "containerd-shim-podvm-v2")


NS = run_namespace("podvm-test")


def make_bundle(root: pathlib.Path, container_id: str, sandbox_id: str | None = None,
                log_fifo: bool = False) -> pathlib.Path:
    bundle = root / container_id
    (bundle / "rootfs").mkdir(parents=True)
    annotations = {"io.kubernetes.cri.container-type": "sandbox" if sandbox_id in (
        None, container_id) else "container"}
    if sandbox_id:
        annotations["io.kubernetes.cri.sandbox-id"] = sandbox_id
    # Namespaces of its own: without them the pod would share the host's network, PID
    # and IPC namespaces, which podvm refuses.
    (bundle / "config.json").write_text(json.dumps({
        "ociVersion": "1.0.2", "annotations": annotations,
        "linux": {"namespaces": [{"type": "network"}, {"type": "pid"}, {"type": "ipc"}]}}))
    if log_fifo:
        os.mkfifo(bundle / "log")
    return bundle


def run_shim(bundle: pathlib.Path, container_id: str, action: str, grpc_address: str,
             namespace: str = NS, timeout: float = 10,
             env: dict | None = None,
             stdin: bytes | None = None) -> subprocess.CompletedProcess:
    """`stdin`: what containerd writes to `start`'s stdin (the runtime options, a marshalled
    Any) and then closes; None: /dev/null, as containerd gives it when there are none."""
    argv = [SHIM, "-namespace", namespace, "-address", grpc_address,
            "-publish-binary", "/usr/bin/containerd", "-id", container_id]
    if action:
        argv.append(action)
    return subprocess.run(argv, cwd=bundle, capture_output=True, timeout=timeout,
                          env=env if env is not None else dict(os.environ),
                          **({"stdin": subprocess.DEVNULL} if stdin is None
                             else {"input": stdin}))


def daemon_pid(namespace: str, group: str) -> int:
    state = json.loads(pathlib.Path(f"/run/podvm/{namespace}/{group}/shim.json").read_text())
    return state["pid"]


def alive(pid: int) -> bool:
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return stat.rsplit(b")", 1)[1].split()[0] != b"Z"


def fd_links(pid: int) -> dict[int, str]:
    """`pid`'s descriptors and what each links to. A running daemon opens and closes files
    as it works (a module while it imports, a file it reads): one closed between listing
    and reading its link is one it no longer holds, and is left out."""
    links = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            links[int(fd)] = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:
            pass
    return links


def open_files(pid: int) -> list[str]:
    """What `pid` holds open (see `fd_links`)."""
    return list(fd_links(pid).values())


async def wait_gone(pid: int, timeout: float = 5) -> None:
    deadline = time.monotonic() + timeout
    while alive(pid) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert not alive(pid), f"shim daemon {pid} still running"


WORKER, PARENT = WORKER_PARENT
"""Command-line marks of a network worker, and of a fork server's worker parent and the
workers it forks, which have its command line (shim/contract/workerparent.py): the tree
collector's (podvm_core/treegc.py)."""


def processes(*marks: bytes, parent: int | None = None) -> list[tuple[int, int]]:
    """(pid, parent pid) of each live process (no zombie) whose command line holds every
    one of `marks`, only the children of `parent` where it is given."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            stat = pathlib.Path(f"/proc/{entry}/stat").read_text()
            cmdline = pathlib.Path(f"/proc/{entry}/cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if state != "Z" and all(m in cmdline for m in marks) and \
                parent in (None, int(ppid)):
            found.append((int(entry), int(ppid)))
    return found


def network_workers(daemon_pid: int) -> list[int]:
    """The daemon's network workers: its children that are, and those a fork server's
    worker parent forked for it, whose socket's peer the daemon holds (not the parent's
    own, which every daemon of the server holds the peer of)."""
    family = dict(processes(WORKER, PARENT))
    forked = {pid for pid, parent in family.items() if parent in family}
    return [pid for pid, parent in processes(WORKER) if parent == daemon_pid or
            pid in forked and socket_peers(pid) & _sockets(daemon_pid)]


def socket_fds(pid: int) -> dict[int, int]:
    """`pid`'s descriptors that are sockets, and their inodes (none of a process gone)."""
    try:
        links = fd_links(pid)
    except OSError:
        return {}
    return {fd: int(link[8:-1]) for fd, link in links.items() if link.startswith("socket:[")}


def _sockets(pid: int) -> set[int]:
    """The inodes of the sockets `pid` holds."""
    return set(socket_fds(pid).values())


def socket_peers(pid: int) -> set[int]:
    """The inodes of the peers of `pid`'s Unix sockets (ss(8): the kernel's sock_diag)."""
    own = _sockets(pid)
    out = subprocess.run(["ss", "-xan"], capture_output=True, text=True).stdout
    peers = set()
    for line in out.splitlines()[1:]:
        fields = line.split()
        try:
            local, peer = int(fields[-3]), int(fields[-1])
        except (IndexError, ValueError):
            continue
        if local in own:
            peers.add(peer)
    return peers
