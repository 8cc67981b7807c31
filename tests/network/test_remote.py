"""The daemon's way in: attach and detach through the worker process, which alone loads
pyroute2. The descriptors cross the process boundary and keep the tap alive."""
from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from shim.network import remote
from shim.network.ahead import WorkerAhead
from shim.network.errors import NamespaceGone, NetworkError
from shim.network.read import read_network
from testbed.shimproc import alive
from tests.network.conftest import POD_MAC, Namespace
from tests.network.test_attach import assert_nothing_of_podvm


async def attach(netns: str):
    worker = await remote.Worker.start()
    try:
        return await worker.attach(netns)
    finally:
        await worker.close()


async def test_attach_in_a_worker_hands_back_live_taps(pod: Namespace) -> None:
    network, nics = await attach(pod.path)
    try:
        assert network == await read_network(pod.path)
        (nic,) = nics
        assert (nic.interface, nic.tap, nic.mac, nic.mtu) == ("eth0", "tap0_podvm", POD_MAC, 1400)
        # The worker has exited: only our descriptor keeps the (non-persistent) tap.
        assert os.readlink(f"/proc/self/fd/{nic.tap_fd}") == "/dev/net/tun"
        assert "tap0_podvm" in pod.links()
        assert pod.ingress_filters("eth0") and pod.ingress_filters("tap0_podvm")
    finally:
        for nic in nics:
            nic.close()
    await remote.detach(pod.path, [n.tap for n in nics])
    assert_nothing_of_podvm(pod)
    await remote.detach(pod.path, ["tap0_podvm"])  # twice: nothing to do


async def test_worker_errors_come_back_typed(pod: Namespace) -> None:
    pod.ip("link", "add", "tap0_podvm", "type", "bridge")  # in the way of podvm's tap
    with pytest.raises(NetworkError, match="tap0_podvm") as err:
        await attach(pod.path)
    assert err.value.netns == pod.path and err.value.interface == "eth0"
    pod.ip("link", "delete", "tap0_podvm")
    assert_nothing_of_podvm(pod)
    with pytest.raises(NamespaceGone):
        await attach("/var/run/netns/podvm-no-such-namespace")
    await remote.detach("/var/run/netns/podvm-no-such-namespace")  # gone: nothing to do


async def test_attach_says_what_it_found_before_it_answers(pod: Namespace) -> None:
    """The worker sends the interfaces before it makes the taps: the shim picks the
    pod's template from them and copies its memory meanwhile (shim/vm/template/restore.py,
    copy_ahead)."""
    seen = []
    worker = await remote.Worker.start()
    try:
        network, nics = await worker.attach(pod.path, seen.append)
    finally:
        await worker.close()
    for nic in nics:
        nic.close()
    assert seen == [network] and network.interfaces[0].mtu == 1400
    await remote.detach(pod.path, [n.tap for n in nics])
    assert_nothing_of_podvm(pod)


async def test_an_attach_that_fails_after_it_found_the_network_is_typed(pod: Namespace) -> None:
    """What the caller started on `found` is its to stop: the error still comes back."""
    pod.ip("link", "add", "tap0_podvm", "type", "bridge")  # in the way of podvm's tap
    seen = []
    worker = await remote.Worker.start()
    try:
        with pytest.raises(NetworkError, match="tap0_podvm"):
            await worker.attach(pod.path, seen.append)
    finally:
        await worker.close()
    assert [len(n.interfaces) for n in seen] == [1]
    pod.ip("link", "delete", "tap0_podvm")
    assert_nothing_of_podvm(pod)


async def test_a_worker_started_ahead_waits_for_its_request(pod: Namespace) -> None:
    worker = await remote.Worker.start()
    await asyncio.sleep(1)  # its imports done, it waits: nothing is made before asked
    assert_nothing_of_podvm(pod)
    _, nics = await worker.attach(pod.path)
    for nic in nics:
        nic.close()
    with pytest.raises(RuntimeError, match="one request"):
        await worker.attach(pod.path)
    await worker.close()  # used: nothing to do
    await remote.detach(pod.path, [n.tap for n in nics])
    assert_nothing_of_podvm(pod)


async def test_a_worker_never_used_leaves_nothing(pod: Namespace) -> None:
    worker = await remote.Worker.start()
    pid = worker._proc.pid
    await worker.close()
    assert worker._proc.returncode == 0
    assert not os.path.exists(f"/proc/{pid}")
    assert_nothing_of_podvm(pod)
    await worker.close()  # twice: nothing to do


async def test_the_pods_worker_is_started_ahead_once_and_attaches(pod: Namespace) -> None:
    """The daemon (or CreateSandbox) and the boot both start it: one worker serves, the
    other ends having done nothing; close() ends the one that served."""
    ahead = WorkerAhead()
    await asyncio.gather(ahead.start(), ahead.start())
    worker = ahead._worker
    await ahead.start()  # started: nothing to do
    assert ahead._worker is worker
    _, nics = await ahead.attach(pod.path)
    for nic in nics:
        nic.close()
    await ahead.close()
    assert worker._proc.returncode == 0
    await ahead.close()  # twice: nothing to do
    await remote.detach(pod.path, [n.tap for n in nics])
    assert_nothing_of_podvm(pod)


async def test_the_pods_worker_closed_unused_leaves_nothing(pod: Namespace) -> None:
    """The pod stopped before it booted, or the daemon exited: the worker ends, and a
    boot after that starts another."""
    ahead = WorkerAhead()
    await ahead.start()
    first = ahead._worker
    await ahead.close()
    assert first._proc.returncode == 0 and ahead._worker is None
    _, nics = await ahead.attach(pod.path)  # none started ahead: started now
    for nic in nics:
        nic.close()
    assert ahead._worker is not first
    await ahead.close()
    await remote.detach(pod.path, [n.tap for n in nics])
    assert_nothing_of_podvm(pod)


def test_the_daemon_side_never_loads_pyroute2() -> None:
    code = ("import sys, shim.network.remote, shim.network.model; "
            "print(sorted(m for m in sys.modules if m.startswith('pyroute2')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]"


async def test_detach_without_a_loop_for_delete(pod: Namespace) -> None:
    _, nics = await attach(pod.path)
    for nic in nics:
        nic.close()
    remote.detach_now(pod.path, ["tap0_podvm"])
    assert_nothing_of_podvm(pod)
    remote.detach_now(pod.path, ["tap0_podvm"])


@pytest.mark.parametrize("parent", [False, True])
def test_a_worker_ends_with_the_process_that_started_it_unless_a_parent(parent: bool) -> None:
    """`delete` kills a daemon that is still on its way out: a worker it had started (its
    request sent, its socket still open elsewhere) must not outlive it, using the install
    tree when the last collector of an uninstalled tree looks. The fork server's worker
    parent serves the daemons the server forked: it stays when the server goes, until
    every holder of its socket's other end has closed it."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    argv = remote.worker_argv(theirs.fileno()) + (["--parent", "0"] if parent else [])
    starter = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys, time\n"
         f"w = subprocess.Popen({argv!r}, pass_fds=({theirs.fileno()},))\n"
         "print(w.pid, flush=True)\ntime.sleep(600)"],
        pass_fds=(theirs.fileno(),), stdout=subprocess.PIPE, text=True)
    try:
        worker = int(starter.stdout.readline())
        time.sleep(1)  # its imports done, waiting on a socket whose ends are all open
        assert alive(worker)
        starter.send_signal(signal.SIGKILL)
        starter.wait()
        deadline = time.monotonic() + 10
        while alive(worker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert alive(worker) == parent
    finally:
        starter.kill()
        starter.wait()
        ours.close()
        theirs.close()
    deadline = time.monotonic() + 10  # the parent sees its socket close and exits
    while alive(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(worker)


@pytest.fixture
def worker_parent():
    """A worker parent as the fork server starts it (shim/contract/workerparent.py),
    loaded: (its process, the socket the daemons ask it on)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    proc = subprocess.Popen(remote.worker_argv(theirs.fileno()) + ["--parent", "0"],
                            pass_fds=(theirs.fileno(),))
    theirs.close()
    try:
        yield proc, ours
    finally:
        ours.close()
        try:
            proc.wait(10)  # its socket's other end closed: it exits by itself
        finally:
            proc.kill()


def _children(pid: int) -> list[int]:
    """`pid`'s children, zombies included."""
    children = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    children.append(int(entry))
        except (OSError, ValueError):
            continue
    return children


async def test_a_worker_parent_forks_a_loaded_worker_for_each_request(
        pod: Namespace, worker_parent) -> None:
    """Each daemon's attach and detach are served by a worker the parent forks, its
    imports done already; each serves one request, exits, and is reaped by the kernel."""
    proc, asks = worker_parent
    attacher = remote.Worker.forked(asks)
    assert attacher is not None
    seen = []
    try:
        network, nics = await attacher.attach(pod.path, seen.append)
    finally:
        await attacher.close()
    assert seen == [network] and "tap0_podvm" in pod.links()
    for nic in nics:
        nic.close()
    ahead = WorkerAhead(asks)
    await ahead.start()
    assert ahead._worker._proc is None  # forked, not started
    await ahead.detach(pod.path, [n.tap for n in nics])
    assert ahead._worker is None
    assert_nothing_of_podvm(pod)
    deadline = time.monotonic() + 10
    while _children(proc.pid) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert _children(proc.pid) == [] and proc.poll() is None  # the workers gone, it stays


async def test_a_daemon_whose_worker_parent_is_gone_starts_its_own(
        pod: Namespace, worker_parent) -> None:
    proc, asks = worker_parent
    proc.kill()
    proc.wait()
    assert remote.Worker.forked(asks) is None
    ahead = WorkerAhead(asks)
    _, nics = await ahead.attach(pod.path)
    for nic in nics:
        nic.close()
    assert [w._proc is not None for w in ahead._used] == [True]  # its own
    await ahead.close()
    await ahead.detach(pod.path, [n.tap for n in nics])
    assert_nothing_of_podvm(pod)


async def test_a_worker_parent_ignores_a_request_without_one_socket(
        pod: Namespace, worker_parent) -> None:
    """Anything on its socket but one socket is dropped, and it goes on forking."""
    proc, asks = worker_parent
    asks.send(b"w")
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    socket.send_fds(asks, [b"w"], [a.fileno(), b.fileno()])
    a.close()
    b.close()
    worker = remote.Worker.forked(asks)
    _, nics = await worker.attach(pod.path)
    await worker.close()
    for nic in nics:
        nic.close()
    await remote.detach(pod.path, [n.tap for n in nics])
    assert_nothing_of_podvm(pod)
    assert proc.poll() is None



async def test_a_detach_after_an_attach_not_yet_closed_gets_a_worker_of_its_own(
        pod: Namespace) -> None:
    """A boot that fails after its attach stops the VM, and detaches, before the boot's
    end closes the attach's worker: the detach gets a worker of its own."""
    ahead = WorkerAhead()
    _, nics = await ahead.attach(pod.path)
    for nic in nics:
        nic.close()
    await ahead.detach(pod.path, [n.tap for n in nics])
    assert_nothing_of_podvm(pod)
    assert ahead._used == [] and ahead._worker is None  # both closed
    await ahead.close()
