"""The fork server (shim/contract/forkserver.py) as containerd meets it: the real shim
binary's `start`, served by a warm parent of its own code, or by itself when there is
none or the one there will not do. Each test's servers live in a directory of its own
(PODVM_TEST_FORKSERVER_DIR) and are stopped at its end, leaving nothing."""
from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from podvm_core.pb.containerd.task.v2 import shim_pb2 as api
from podvm_core.ttrpc import Client, Code, TtrpcError
from shim.contract import forkclient, forkserver, identity
from testbed.shimproc import (NS, PARENT, WORKER, alive, make_bundle,
                              network_workers, open_files, processes, run_shim, socket_fds,
                              socket_peers)

TASK = "containerd.task.v2.Task"
ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture
def grpc_address(tmp_path: pathlib.Path) -> str:
    return str(tmp_path / "containerd.sock")


@pytest.fixture
def servers():
    """(directory, environment for `start`): the test's fork servers; each is stopped
    afterwards, and must have removed its socket and lock. Outside pytest's own
    directories (0700): a test opens it to another uid."""
    where = os.path.join(tempfile.mkdtemp(prefix="podvm-forkserver-test-"), "servers")
    env = {**os.environ, forkclient.TEST_DIRECTORY_ENV: where,
           forkserver.TEST_IDLE_ENV: "60"}
    yield where, env
    pids = []
    for lock in pathlib.Path(where).glob("*.lock"):  # each server's, taken before it loads
        code = lock.name.removesuffix(".lock")
        _wait(lambda: forkclient.server_pid(code, where) or not lock.exists(),
              f"the fork server of {code} neither came up nor went")
        pids.append(forkclient.server_pid(code, where))
    pids = [pid for pid in pids if pid]
    for pid in pids:
        os.kill(pid, signal.SIGTERM)
    for pid in pids:
        _wait(lambda: not alive(pid), f"fork server {pid} did not stop")
    left = os.listdir(where) if os.path.isdir(where) else []
    shutil.rmtree(os.path.dirname(where))
    assert left == []


def _wait(done, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def wait_server(where: str, code: str) -> int:
    """The server's pid once it listens (it loads first: on a busy machine, seconds)."""
    _wait(lambda: forkclient.server_pid(code, where), f"no fork server in {where}")
    return forkclient.server_pid(code, where)  # type: ignore[return-value]


def shim_state(group: str) -> dict:
    return json.loads(pathlib.Path(f"/run/podvm/{NS}/{group}/shim.json").read_text())


def start(tmp_path, group: str, grpc_address: str, env: dict) -> pathlib.Path:
    bundle = make_bundle(tmp_path, group, sandbox_id=group)
    result = run_shim(bundle, group, "start", grpc_address, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.decode() == (bundle / "address").read_text()
    return bundle


@pytest.fixture
def delete_after(grpc_address):
    """Bundles whose pods are deleted (their daemons stopped) when the test ends."""
    bundles: list[tuple[pathlib.Path, dict]] = []
    yield bundles
    for bundle, env in bundles:
        run_shim(bundle, bundle.name, "delete", grpc_address, env=env)


async def test_a_start_served_by_the_fork_server_gives_a_working_daemon(
        tmp_path, grpc_address, servers, delete_after) -> None:
    where, env = servers
    code = identity.own_name()
    delete_after.append((start(tmp_path, "sb1", grpc_address, env), env))
    assert "forkserver" not in shim_state("sb1")  # the first: no server yet, it spawned one
    server = wait_server(where, code)

    env2 = {**env, "PODVM_TEST_MARK": "given-to-sb2"}
    bundle = start(tmp_path, "sb2", grpc_address, env2)
    delete_after.append((bundle, env2))
    state = shim_state("sb2")
    pid = state["pid"]
    assert state["forkserver"] == server
    assert os.getsid(pid) == pid and os.getpgid(pid) == pid  # its own session
    assert os.readlink(f"/proc/{pid}/cwd") == str(bundle)
    environ = pathlib.Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    assert b"PODVM_TEST_MARK=given-to-sb2" in environ
    cmdline = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
    assert b"\0-id\0sb2\0" in cmdline and cmdline.endswith(b"\0start\0")  # its `start`'s
    own_ns = os.readlink(f"/proc/{pid}/ns/mnt")  # the pod's own mount namespace
    assert own_ns not in (os.readlink("/proc/self/ns/mnt"),
                          os.readlink(f"/proc/{server}/ns/mnt"))
    links = open_files(pid)
    assert not [link for link in links if link.startswith("pipe:") or where in link], links
    async with await Client.connect(state["address"]) as client:
        reply = await client.call(TASK, "Connect", api.ConnectRequest(id="sb2"),
                                  api.ConnectResponse)
        assert reply.shim_pid == pid
        with pytest.raises(TtrpcError) as err:  # answered by the Task API's code
            await client.call(TASK, "State", api.StateRequest(id="nope"), api.StateResponse)
        assert err.value.code == Code.NOT_FOUND


def test_a_stale_socket_is_replaced(tmp_path, grpc_address, servers, delete_after) -> None:
    where, env = servers
    code = identity.own_name()
    os.mkdir(where, 0o700)
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    dead.bind(forkclient.socket_path(code, where))  # its server died: nobody listens
    dead.close()
    delete_after.append((start(tmp_path, "sb1", grpc_address, env), env))
    server = wait_server(where, code)
    delete_after.append((start(tmp_path, "sb2", grpc_address, env), env))
    assert shim_state("sb2")["forkserver"] == server


def test_a_request_from_a_peer_that_is_not_root_is_refused(tmp_path, grpc_address, servers,
                                                            delete_after) -> None:
    """Only root may have the server fork: its socket is root's alone, and a peer whose
    uid is not 0 (were the socket opened by mistake) is refused before anything is read."""
    where, env = servers
    code = identity.own_name()
    delete_after.append((start(tmp_path, "sb1", grpc_address, env), env))
    wait_server(where, code)
    os.chmod(os.path.dirname(where), 0o755)
    os.chmod(where, 0o755)
    os.chmod(forkclient.socket_path(code, where), 0o666)
    flags = dict(zip(("namespace", "id", "address", "publish_binary", "bundle", "socket",
                      "debug", "info", "version", "help", "action"),
                     (NS, "intruder", grpc_address, "", "/", "unix:///nowhere", False,
                      False, False, False, "serve")))
    request = json.dumps({"flags": flags, "env": {}, "cmdline":
                          "containerd-shim-podvm-v2\0-id\0intruder\0start\0"}).encode()
    reading, writing = os.pipe()
    child = os.fork()
    if child == 0:
        code_ = 1
        try:
            os.close(reading)
            os.setgid(65534)
            os.setuid(65534)
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            conn.settimeout(10)
            conn.connect(forkclient.socket_path(code, where))
            # The refusal comes before the server reads anything: a server that read
            # the request first would wait for it, and answer only when it times out.
            os.write(writing, conn.recv(1 << 16) or b"(closed)")
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            here = os.open("/", os.O_RDONLY | os.O_DIRECTORY)
            with contextlib.suppress(OSError):
                socket.send_fds(conn, [request], [listener.fileno(), here])
            code_ = 0
        except BaseException as exc:
            os.write(writing, repr(exc).encode())
        finally:
            os._exit(code_)
    os.close(writing)
    with os.fdopen(reading, "rb") as f:
        answer = f.read()
    os.waitpid(child, 0)
    assert b"uid 65534, not root" in answer, answer
    intruders = [p for p in os.listdir("/proc") if p.isdigit() and
                 b"-id\0intruder\0" in _cmdline(p)]
    assert intruders == []


def _cmdline(pid: str) -> bytes:
    try:
        return pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


async def test_a_server_of_other_code_is_never_used(tmp_path, grpc_address, servers,
                                                    delete_after) -> None:
    """A copy of the shim's code, changed after its server came up (an upgrade, an edit):
    the next `start` does not get a daemon of the old code."""
    where, env = servers
    copy = tmp_path / "code"
    shutil.copytree(ROOT / "shim", copy / "shim",
                    ignore=shutil.ignore_patterns("__pycache__"))
    os.symlink(ROOT / "podvm_core", copy / "podvm_core")
    env = {**env, "PYTHONPATH": str(copy)}

    def code_of_copy() -> str:
        return subprocess.run([sys.executable, "-c", "import shim.contract.identity as i; "
                               "print(i.own_name())"], env=env, cwd=copy, capture_output=True,
                              text=True, check=True).stdout.strip()

    old = code_of_copy()
    delete_after.append((start(tmp_path, "sb1", grpc_address, env), env))
    old_server = wait_server(where, old)
    version = copy / "shim" / "__init__.py"
    version.write_text(version.read_text().replace('__version__ = "', '__version__ = "9.'))
    assert code_of_copy() != old
    delete_after.append((start(tmp_path, "sb2", grpc_address, env), env))
    state = shim_state("sb2")
    assert state.get("forkserver", 0) != old_server
    async with await Client.connect(state["address"]) as client:
        reply = await client.call(TASK, "Connect", api.ConnectRequest(id="sb2"),
                                  api.ConnectResponse)
    assert reply.version.startswith("9."), reply.version  # the new code's daemon


def test_the_fork_server_exits_when_idle_and_leaves_nothing(tmp_path, grpc_address, servers,
                                                            delete_after) -> None:
    where, env = servers
    env = {**env, forkserver.TEST_IDLE_ENV: "1"}
    code = identity.own_name()
    bundle = start(tmp_path, "sb1", grpc_address, env)
    delete_after.append((bundle, env))
    server = wait_server(where, code)
    _wait(lambda: not alive(server), "the fork server did not exit when idle", timeout=30)
    assert os.listdir(where) == []
    assert alive(shim_state("sb1")["pid"])  # its daemons are not its: they serve on


def test_the_fork_server_stays_idle_while_a_daemon_it_forked_runs(
        tmp_path, grpc_address, servers, delete_after) -> None:
    """A node's pods outlive the server's idle time: their removal still gets network
    workers forked loaded by its worker parent, and a later pod is forked warm. Once the
    last of its daemons is gone, the idle server goes. The first `start`'s daemon, which
    spawned the server rather than being forked by it, does not keep it."""
    where, env = servers
    env = {**env, forkserver.TEST_IDLE_ENV: "1"}
    code = identity.own_name()
    delete_after.append((start(tmp_path, "sb1", grpc_address, env), env))
    server = wait_server(where, code)
    forked = start(tmp_path, "sb2", grpc_address, env)
    delete_after.append((forked, env))
    assert shim_state("sb2")["forkserver"] == server
    time.sleep(3)  # three times its idle time
    assert alive(server)
    assert worker_parents(server), "its worker parent is gone"
    run_shim(forked, "sb2", "delete", grpc_address, env=env)  # sb2's daemon stops
    _wait(lambda: not alive(server), "the fork server did not exit once idle and alone",
          timeout=30)
    assert alive(shim_state("sb1")["pid"])


def test_the_tree_collector_stops_a_fork_server_but_keeps_a_tree_a_pod_uses(tmp_path) -> None:
    """A fork server holds its tree (its Python, its modules) but serves no pod: the
    collector (podvm_core/treegc.py) stops it and removes the tree, where a process of a
    pod keeps its tree."""
    from podvm_core import treegc

    opt = tmp_path / "opt" / "podvm"
    for name in ("aaaaaa", "bbbbbb", "cccccc"):
        (opt / name).mkdir(parents=True)
    os.symlink("cccccc", opt / "current")
    server = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from shim.contract.proctitle import "
         "set_cmdline; set_cmdline(b'containerd-shim-podvm-v2\\0forkserver\\0x\\0', b''); "
         "print('ready', flush=True); time.sleep(120)"],
        cwd=opt / "aaaaaa", stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)})
    pod = subprocess.Popen(["sleep", "120"], cwd=opt / "bbbbbb")
    try:
        assert server.stdout.readline() == b"ready\n"  # type: ignore[union-attr]
        assert treegc.collect(str(tmp_path)) == ["aaaaaa"]
        assert server.wait(timeout=10) == -signal.SIGTERM
        assert sorted(p.name for p in opt.iterdir()) == ["bbbbbb", "cccccc", "current"]
    finally:
        for process in (server, pod):
            process.kill()
            process.wait()


def test_the_server_never_imports_from_the_bundle(tmp_path, grpc_address, servers,
                                                  delete_after) -> None:
    """`start` runs in the bundle, and the server is spawned from there (`python -m`):
    a `shim` package planted beside config.json is never what the server imports."""
    where, env = servers
    bundle = make_bundle(tmp_path, "sb1", sandbox_id="sb1")
    marker = tmp_path / "planted-code-ran"
    (bundle / "shim").mkdir()
    (bundle / "shim" / "__init__.py").write_text(
        f"open({str(marker)!r}, 'w').close()\nraise SystemExit(1)\n")
    result = run_shim(bundle, "sb1", "start", grpc_address, env=env)
    delete_after.append((bundle, env))
    assert result.returncode == 0, result.stderr
    wait_server(where, identity.own_name())
    assert not marker.exists()


def test_setting_the_command_line_leaves_the_shared_libc_handle_as_it_was() -> None:
    """A daemon the server forked sets its command line through prctl; the argument types
    that needs must not stick to the handle every other caller shares (the QEMU jail's pid
    filter passes prctl a pointer: 'argument 3: wrong type' at every served pod's boot)."""
    import subprocess
    import sys

    probe = ("import ctypes\n"
             "from shim.contract import proctitle\n"
             "from shim.libc import libc\n"
             "proctitle.set_cmdline(b'probe\\0', b'A=1\\0')\n"
             "assert libc().prctl.argtypes is None, libc().prctl.argtypes\n"
             "prog = ctypes.c_int(0)\n"
             "libc().prctl(0, 0, ctypes.byref(prog), 0, 0)  # a pointer still passes\n"
             "print(open('/proc/self/cmdline', 'rb').read())\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert "b'probe\\x00'" in done.stdout


def worker_parents(server: int) -> set[int]:
    """The fork server's worker parents alive (shim/contract/workerparent.py): one."""
    return {pid for pid, _ in processes(WORKER, PARENT, parent=server)}


def _fd_flags(pid: int, fd: int) -> int:
    with open(f"/proc/{pid}/fdinfo/{fd}") as f:
        return next(int(line.split()[1], 8) for line in f if line.startswith("flags:"))


def network_bundle(tmp_path, group: str) -> pathlib.Path:
    """A sandbox container's bundle whose spec names the pod's network namespace."""
    bundle = make_bundle(tmp_path, group, sandbox_id=group)
    spec = json.loads((bundle / "config.json").read_text())
    spec["linux"]["namespaces"][0]["path"] = "/var/run/netns/podvm-never-used"
    (bundle / "config.json").write_text(json.dumps(spec))
    return bundle


async def test_each_daemon_gets_its_network_workers_forked_loaded_and_none_is_left(
        tmp_path, grpc_address, servers, delete_after) -> None:
    """The server keeps one worker parent, loaded, and every daemon it forks holds its
    socket: a pod with a network gets its worker forked from it at once, without waiting
    for a worker's imports; a pod without one gets none; a parent that died is started
    again; the server's exit ends it."""
    where, env = servers
    code = identity.own_name()
    delete_after.append((start(tmp_path, "sb1", grpc_address, env), env))
    server = wait_server(where, code)
    _wait(lambda: len(worker_parents(server)) == 1, "the server started no worker parent")
    (parent,) = worker_parents(server)
    # loaded, it forks under the daemons' scheduling policy, not the one it loaded at
    _wait(lambda: os.sched_getscheduler(parent) == os.sched_getscheduler(server),
          "the worker parent still runs at SCHED_IDLE")

    bundle = network_bundle(tmp_path, "sb2")
    result = run_shim(bundle, "sb2", "start", grpc_address, env=env)
    assert result.returncode == 0, result.stderr
    delete_after.append((bundle, env))
    daemon = shim_state("sb2")["pid"]
    assert shim_state("sb2")["forkserver"] == server
    _wait(lambda: network_workers(daemon), "the daemon started no network worker ahead")
    (worker,) = network_workers(daemon)
    assert processes(WORKER, PARENT, parent=parent) == [(worker, parent)]  # forked
    # The daemon holds the parent's socket close-on-exec: the pod's QEMU and virtiofsd,
    # which it executes, never hold a way to ask root's worker for a netns of their choice.
    held = [fd for fd, inode in socket_fds(daemon).items() if inode in socket_peers(parent)]
    assert len(held) == 1, held
    assert _fd_flags(daemon, held[0]) & os.O_CLOEXEC

    # a pod with no network of its own: its daemon has no worker
    delete_after.append((start(tmp_path, "sb3", grpc_address, env), env))
    assert network_workers(shim_state("sb3")["pid"]) == []

    async with await Client.connect(result.stdout.decode()) as client:
        with contextlib.suppress(Exception):  # closed under the answer: success
            await client.call(TASK, "Shutdown", api.ShutdownRequest(id="sb2"),
                              api.StateResponse)
    _wait(lambda: not alive(daemon) and not alive(worker),
          "the daemon's network worker outlived it")
    assert worker_parents(server) == {parent}

    os.kill(parent, signal.SIGKILL)  # started again once the server is idle
    _wait(lambda: worker_parents(server) - {parent}, "the server started no worker parent")
    (again,) = worker_parents(server)
    os.kill(server, signal.SIGTERM)
    _wait(lambda: not alive(server) and not alive(again),
          "the server's exit left its worker parent")
