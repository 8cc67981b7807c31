"""The real shim binary against its contract with containerd (docs/design.md, The process
contract)."""
from __future__ import annotations

import asyncio
import json
import os
import pathlib
import re
import signal
import stat
import subprocess
import time

import pytest

from podvm_core.pb.containerd.task.v2 import shim_pb2 as api
from podvm_core.ttrpc import Client, Code, TtrpcError
from shim.host import paths
from testbed.containerd import shims_of
from testbed.shimproc import (NS, SHIM, alive, daemon_pid, make_bundle, network_workers,
                              open_files, run_shim, wait_gone)

TASK = "containerd.task.v2.Task"


@pytest.fixture
def grpc_address(tmp_path: pathlib.Path) -> str:
    """A containerd address unique to the test, so its shim sockets are too."""
    return str(tmp_path / "containerd.sock")


@pytest.fixture
def started(tmp_path, grpc_address):
    """A sandbox's daemon started through `start`; killed and cleaned up afterwards."""
    bundle = make_bundle(tmp_path, "sb1", sandbox_id="sb1")
    result = run_shim(bundle, "sb1", "start", grpc_address)
    assert result.returncode == 0, result.stderr
    yield bundle, result.stdout.decode()
    run_shim(bundle, "sb1", "delete", grpc_address)


def mount_points(pid: int | str) -> set[str]:
    """What is mounted in the mount namespace of `pid` (the daemon's: the pod's)."""
    with open(f"/proc/{pid}/mountinfo") as f:
        return {line.split()[4] for line in f}


def test_start_prints_only_the_address_and_detaches(started) -> None:
    bundle, address = started
    assert re.fullmatch(r"unix:///run/containerd/s/[0-9a-f]{64}", address)
    assert (bundle / "address").read_text() == address
    path = address.removeprefix("unix://")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    pid = daemon_pid(NS, "sb1")
    assert alive(pid)
    assert os.getpgid(pid) == pid and os.getsid(pid) == pid  # own group and session
    fds = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in (0, 1)}
    assert fds == {"/dev/null"}


def test_daemon_holds_nothing_of_start_but_its_socket(started) -> None:
    """`start` forks the daemon: containerd reads `start`'s output until every copy of its
    pipes is closed, so the daemon must hold none of them (nor anything else of `start`)."""
    pid = daemon_pid(NS, "sb1")
    links = open_files(pid)
    assert not [link for link in links if link.startswith("pipe:")], links
    # A module file may be open for a moment: the daemon imports as it comes up. The
    # host's mount namespace stays open: the daemon's binds clone host paths there.
    host_ns = os.readlink("/proc/self/ns/mnt")
    assert all(link in ("/dev/null", host_ns) or link.startswith(("socket:", "anon_inode:"))
               or link.endswith((".py", ".pyc", ".so")) for link in links), links


def test_the_daemon_has_a_mount_namespace_of_its_own(started) -> None:
    """Its mounts (rootfs, binds into the shared directory) are never mountpoints in the
    host's namespace, where they would make rmdir of a volume's submount fail (EBUSY);
    the host's are there."""
    pid = daemon_pid(NS, "sb1")
    assert os.readlink(f"/proc/{pid}/ns/mnt") != os.readlink("/proc/self/ns/mnt")
    assert {"/", "/proc", "/sys"} <= mount_points(pid)


def test_delete_of_a_container_unmounts_it_in_the_pod_s_namespace(started, tmp_path,
                                                                  grpc_address) -> None:
    """containerd runs `delete` for a container whose Delete failed while the pod's daemon
    lives: its rootfs and shared files are mounts in the daemon's namespace, unmounted
    there; the daemon serves on. The daemon's record still names the container's rootfs
    (it goes from there once the files are unshared)."""
    pid = daemon_pid(NS, "sb1")
    workload = make_bundle(tmp_path, "c1", sandbox_id="sb1")
    shared = pathlib.Path(f"/run/podvm/{NS}/sb1/shared/c1/rootfs")
    shared.mkdir(parents=True)
    for point in (workload / "rootfs", shared):
        subprocess.run(["nsenter", f"--mount=/proc/{pid}/ns/mnt", "mount", "-t", "tmpfs",
                        "tmpfs", str(point)], check=True)
        assert str(point) in mount_points(pid) and str(point) not in mount_points("self")
    record = pathlib.Path(f"/run/podvm/{NS}/sb1/{paths.POD_STATE_FILE}")
    record.write_text(json.dumps({"rootfs": {"c1": str(workload / "rootfs")}}))
    try:
        result = run_shim(workload, "c1", "delete", grpc_address)
    finally:
        record.unlink()  # not a whole pod's state: the daemon without a pod has none
    assert result.returncode == 0, result.stderr
    assert api.DeleteResponse.FromString(result.stdout).exit_status == 137
    assert not {str(workload / "rootfs"), str(shared)} & mount_points(pid)
    assert alive(pid) and daemon_pid(NS, "sb1") == pid


def test_containers_of_a_pod_share_one_daemon(started, tmp_path, grpc_address) -> None:
    _, address = started
    pid = daemon_pid(NS, "sb1")
    workload = make_bundle(tmp_path, "c1", sandbox_id="sb1")
    result = run_shim(workload, "c1", "start", grpc_address)
    assert result.returncode == 0 and result.stdout.decode() == address
    assert (workload / "address").read_text() == address
    assert daemon_pid(NS, "sb1") == pid
    other = make_bundle(tmp_path, "sb2", sandbox_id="sb2")
    result = run_shim(other, "sb2", "start", grpc_address)
    assert result.stdout.decode() != address
    run_shim(other, "sb2", "delete", grpc_address)


def test_start_without_a_mount_namespace_fails_in_its_own_words(tmp_path,
                                                                grpc_address) -> None:
    """A shim that may not unshare (no CAP_SYS_ADMIN) does not serve a pod whose mounts
    would be the host's: `start` fails, saying why, and leaves no socket or daemon."""
    bundle = make_bundle(tmp_path, "nons", sandbox_id="nons")
    argv = ["setpriv", "--bounding-set=-sys_admin", "--inh-caps=-sys_admin", "--", SHIM,
            "-namespace", NS, "-address", grpc_address, "-publish-binary",
            "/usr/bin/containerd", "-id", "nons", "start"]
    result = subprocess.run(argv, cwd=bundle, capture_output=True, timeout=10,
                            stdin=subprocess.DEVNULL)
    assert result.returncode == 1 and result.stdout == b""
    assert b"cannot make the pod's mount namespace" in result.stderr, result.stderr
    assert b"CAP_SYS_ADMIN" in result.stderr, result.stderr
    assert not os.path.exists(f"/run/podvm/{NS}/nons/shim.json")
    assert not (bundle / "address").exists()
    assert not os.path.exists(paths.socket_path(paths.socket_address(grpc_address, NS, "nons")))
    assert shims_of(grpc_address) == []


def test_stale_socket_is_replaced(tmp_path, grpc_address) -> None:
    bundle = make_bundle(tmp_path, "sb1", sandbox_id="sb1")
    first = run_shim(bundle, "sb1", "start", grpc_address).stdout.decode()
    pid = daemon_pid(NS, "sb1")
    os.kill(pid, signal.SIGKILL)  # dies without removing its socket
    while alive(pid):
        time.sleep(0.01)
    path = first.removeprefix("unix://")
    assert os.path.exists(path)
    again = run_shim(bundle, "sb1", "start", grpc_address)
    assert again.returncode == 0 and again.stdout.decode() == first
    assert daemon_pid(NS, "sb1") != pid and alive(daemon_pid(NS, "sb1"))
    run_shim(bundle, "sb1", "delete", grpc_address)


async def test_task_api_before_any_create(started) -> None:
    bundle, address = started
    pid = daemon_pid(NS, "sb1")
    async with await Client.connect(address,
                                    metadata=[("containerd-namespace-ttrpc", NS)]) as c:
        for service in (TASK, "containerd.task.v3.Task"):
            resp = await c.call(service, "Connect", api.ConnectRequest(id="sb1"),
                                api.ConnectResponse)
            assert resp.shim_pid == pid and resp.task_pid == 0 and resp.version
        for method, request in [("State", api.StateRequest(id="nope")),
                                ("Delete", api.DeleteRequest(id="nope")),
                                ("Kill", api.KillRequest(id="nope", signal=9)),
                                ("Start", api.StartRequest(id="nope")),
                                ("Wait", api.WaitRequest(id="nope")),
                                ("Pids", api.PidsRequest(id="nope"))]:
            with pytest.raises(TtrpcError) as err:
                await c.call(TASK, method, request, api.StateResponse)
            assert err.value.code == Code.NOT_FOUND and "nope" in err.value.message, method


async def test_create_answers_clearly(started, tmp_path) -> None:
    bundle, address = started
    bad_config = tmp_path / "bad.toml"
    bad_config.write_text("[hypervisor.qemu]\ndefault_vcpus = -1\n")
    from podvm_core.pb.containerd.runtimeoptions.v1.api_pb2 import Options

    async with await Client.connect(address) as c:
        with pytest.raises(TtrpcError) as err:
            await c.call(TASK, "Create", api.CreateTaskRequest(id="sb1", bundle="/nonexistent"),
                         api.CreateTaskResponse)
        assert err.value.code == Code.INVALID_ARGUMENT and "/nonexistent" in err.value.message
        (tmp_path / "empty").mkdir()
        with pytest.raises(TtrpcError) as err:
            await c.call(TASK, "Create", api.CreateTaskRequest(id="sb1",
                                                               bundle=str(tmp_path / "empty")),
                         api.CreateTaskResponse)
        assert err.value.code == Code.INVALID_ARGUMENT and "config.json" in err.value.message
        req = api.CreateTaskRequest(id="sb1", bundle=str(bundle))
        req.options.Pack(Options(config_path=str(bad_config)))
        assert req.options.type_url.endswith("runtimeoptions.v1.Options")
        with pytest.raises(TtrpcError) as err:
            await c.call(TASK, "Create", req, api.CreateTaskResponse)
        assert err.value.code == Code.INVALID_ARGUMENT
        assert "default_vcpus" in err.value.message and str(bad_config) in err.value.message
        missing_kernel = tmp_path / "nokernel.toml"
        missing_kernel.write_text('[hypervisor.qemu]\nkernel = "/nonexistent/vmlinux"\n')
        req.options.Pack(Options(config_path=str(missing_kernel)))
        with pytest.raises(TtrpcError) as err:
            await c.call(TASK, "Create", req, api.CreateTaskResponse)
        assert err.value.code == Code.FAILED_PRECONDITION
        assert "/nonexistent/vmlinux" in err.value.message and "kernel" in err.value.message
        # Nothing was half-made: the container does not exist.
        with pytest.raises(TtrpcError) as err:
            await c.call(TASK, "State", api.StateRequest(id="sb1"), api.StateResponse)
        assert err.value.code == Code.NOT_FOUND
    assert str(bundle / "rootfs") not in mount_points(daemon_pid(NS, "sb1"))


async def test_shutdown_exits_and_cleans_up(started) -> None:
    bundle, address = started
    pid = daemon_pid(NS, "sb1")
    async with await Client.connect(address) as c:
        try:
            await c.call(TASK, "Shutdown", api.ShutdownRequest(id="sb1"), api.StateResponse)
        except Exception:
            pass  # a connection closed during Shutdown is success for containerd
    await wait_gone(pid)
    assert not os.path.exists(address.removeprefix("unix://"))
    assert not os.path.exists(f"/run/podvm/{NS}/sb1")


async def test_a_sandbox_with_a_network_namespace_gets_its_network_worker_at_start(
        tmp_path, grpc_address) -> None:
    """The daemon starts the worker that will bridge the pod's network before the Create
    that needs it comes; it ends with the daemon, having done nothing."""
    bundle = make_bundle(tmp_path, "sb1", sandbox_id="sb1")
    spec = json.loads((bundle / "config.json").read_text())
    spec["linux"]["namespaces"][0]["path"] = "/var/run/netns/podvm-never-used"
    (bundle / "config.json").write_text(json.dumps(spec))
    result = run_shim(bundle, "sb1", "start", grpc_address)
    assert result.returncode == 0, result.stderr
    try:
        pid = daemon_pid(NS, "sb1")
        deadline = time.monotonic() + 10
        while not network_workers(pid) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        (worker,) = network_workers(pid)
        async with await Client.connect(result.stdout.decode()) as c:
            try:
                await c.call(TASK, "Shutdown", api.ShutdownRequest(id="sb1"),
                             api.StateResponse)
            except Exception:
                pass  # a connection closed during Shutdown is success for containerd
        await wait_gone(pid)
        await wait_gone(worker)
    finally:
        run_shim(bundle, "sb1", "delete", grpc_address)


async def test_exiting_daemon_leaves_state_a_newer_daemon_owns(started) -> None:
    """A daemon given up for dead whose id was started again must not remove what the
    new daemon uses when it finally exits."""
    pid = daemon_pid(NS, "sb1")
    state = pathlib.Path(f"/run/podvm/{NS}/sb1/shim.json")
    newer = os.getpid()  # stands for the newer daemon: alive, and not `pid`
    state.write_text(state.read_text().replace(f'"pid": {pid}', f'"pid": {newer}'))
    os.kill(pid, signal.SIGTERM)
    await wait_gone(pid)
    assert state.exists()
    state.write_text(state.read_text().replace(f'"pid": {newer}', f'"pid": {pid}'))


def test_delete_after_a_lost_daemon(started, grpc_address) -> None:
    bundle, address = started
    pid = daemon_pid(NS, "sb1")
    result = run_shim(bundle, "sb1", "delete", grpc_address)
    assert result.returncode == 0, result.stderr
    response = api.DeleteResponse.FromString(result.stdout)
    assert response.exit_status == 137 and response.exited_at.seconds > 0
    deadline = time.monotonic() + 5
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not alive(pid)
    assert not os.path.exists(address.removeprefix("unix://"))
    assert not os.path.exists(f"/run/podvm/{NS}/sb1")
    again = run_shim(bundle, "sb1", "delete", grpc_address)  # idempotent
    assert again.returncode == 0
    assert api.DeleteResponse.FromString(again.stdout).exit_status == 137


def test_daemon_logs_structured_lines_to_the_log_fifo(tmp_path, grpc_address) -> None:
    bundle = make_bundle(tmp_path, "sb1", sandbox_id="sb1", log_fifo=True)
    reader = os.open(bundle / "log", os.O_RDONLY | os.O_NONBLOCK)
    try:
        assert run_shim(bundle, "sb1", "start", grpc_address).returncode == 0
        data = b""
        deadline = time.monotonic() + 10
        while b"\n" not in data and time.monotonic() < deadline:
            try:
                data += os.read(reader, 65536)
            except BlockingIOError:
                time.sleep(0.02)
        line = data.decode().splitlines()[0]
        assert re.match(r'time="[^"]+Z" level=info msg=', line), line
        assert "id=sb1" in line and f"namespace={NS}" in line
    finally:
        run_shim(bundle, "sb1", "delete", grpc_address)
        os.close(reader)


def _read_lines(fd: int, until: bytes = b"\n", timeout: float = 10) -> bytes:
    data = b""
    deadline = time.monotonic() + timeout
    while until not in data and time.monotonic() < deadline:
        try:
            data += os.read(fd, 65536)
        except BlockingIOError:
            time.sleep(0.02)
    return data


async def test_expected_errors_leave_no_line_in_the_log(tmp_path, grpc_address) -> None:
    """containerd asks for tasks it has deleted (NOT_FOUND is the expected answer):
    that must not fill its log; a request refused for another reason still shows."""
    bundle = make_bundle(tmp_path, "sb1", sandbox_id="sb1", log_fifo=True)
    reader = os.open(bundle / "log", os.O_RDONLY | os.O_NONBLOCK)
    try:
        result = run_shim(bundle, "sb1", "start", grpc_address)
        assert result.returncode == 0
        assert b"serving" in _read_lines(reader)
        async with await Client.connect(result.stdout.decode()) as c:
            for i in range(50):
                for method, request in [("State", api.StateRequest(id=f"gone{i}")),
                                        ("Delete", api.DeleteRequest(id=f"gone{i}"))]:
                    with pytest.raises(TtrpcError) as err:
                        await c.call(TASK, method, request, api.StateResponse)
                    assert err.value.code == Code.NOT_FOUND
            with pytest.raises(TtrpcError) as err:
                await c.call(TASK, "Create", api.CreateTaskRequest(id="x", bundle="/none"),
                             api.CreateTaskResponse)
            assert err.value.code == Code.INVALID_ARGUMENT
        log = _read_lines(reader, until=b"INVALID_ARGUMENT").decode()
        assert "INVALID_ARGUMENT" in log and "/none" in log
        assert "NOT_FOUND" not in log and "gone" not in log, log
    finally:
        run_shim(bundle, "sb1", "delete", grpc_address)
        os.close(reader)


def test_version_help_and_bad_flags(tmp_path) -> None:
    import subprocess

    v = subprocess.run([SHIM, "-v"], capture_output=True, text=True)
    assert v.returncode == 0 and "Version:" in v.stdout
    h = subprocess.run([SHIM, "--help"], capture_output=True, text=True)
    assert h.returncode == 0 and "start" in h.stdout and "delete" in h.stdout
    bad = subprocess.run([SHIM, "-bogus", "start"], capture_output=True, text=True)
    assert bad.returncode == 2 and "-bogus" in bad.stderr
    lonely = subprocess.run([SHIM, "-id", "x"], capture_output=True, text=True, cwd=tmp_path)
    assert lonely.returncode == 1  # the daemon without the socket `start` hands it
