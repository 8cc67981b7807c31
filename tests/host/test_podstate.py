"""sandbox.json as one typed value: written whole, read back equal, and refused by name
when it is not this podvm's; `delete` and `podvmctl status` read it the same way."""
from __future__ import annotations

import dataclasses
import json
import pathlib
import subprocess
import sys
import time

import pytest

import cgroups
from cgroups import SandboxLayout
from shim.host import cleanup, paths
from shim import config
from podvmctl import cli as ctl, status
from shim.host.podstate import (STATE_FILE, VERSION, CgroupState, PodState, PodStateError,
                                VMReport, state_path)
from shim.host.processes import start_time
from shim.resources import ContainerResources, Host, plan_sandbox
from shim.resources.model import request_from_config
from testbed.namespaces import run_namespace
from testbed.prereqs import require_root

NS = run_namespace("podstate-test")


def plan():
    return plan_sandbox(request_from_config(config.Config(), ContainerResources(
        cpu_quota=150_000, cpu_period=100_000, memory_limit=256 << 20)),
        Host(cpus=8, memory_mib=16384))


def state(**changes) -> PodState:
    value = PodState(
        sandbox_id="sb1",
        cgroup=CgroupState(manager=cgroups.detect().to_state(),
                           layout=SandboxLayout("/kubepods/burstable/pod1", "sb1"),
                           overhead=SandboxLayout("/podvm_overhead", "sb1")),
        plan=plan(), qmp_socket="/run/podvm/ns/sb1/vm/qmp.sock", qemu_pid=1234,
        qemu_start_time=5678, rootfs={"sb1": "/b/sb1/rootfs", "c2": "/b/c2/rootfs"},
        vcpu_pins=("3", "2,6"),
        vm=VMReport(online_cpus=2, memory_total_mib=1800, at=1.5, qemu_vcpus=2,
                    qemu_memory_mib=2304))
    return dataclasses.replace(value, **changes)


def test_every_field_survives_the_file(tmp_path) -> None:
    path = str(tmp_path / STATE_FILE)
    written = state()
    written.save(path)
    read = PodState.load(path)
    assert read == written
    assert read.plan.explanation == written.plan.explanation  # not part of ==
    data = json.loads(pathlib.Path(path).read_text())
    assert data["version"] == VERSION and data["qemu_pid"] == 1234  # what tools read
    minimal = PodState(sandbox_id="sb1", cgroup=written.cgroup, plan=written.plan)
    minimal.save(path)
    assert PodState.load(path) == minimal and minimal.vm is None


def test_a_change_is_a_new_value(tmp_path) -> None:
    before = state()
    with pytest.raises(dataclasses.FrozenInstanceError):
        before.qemu_pid = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        before.rootfs["c3"] = "/x"  # type: ignore[index]
    after = dataclasses.replace(before, rootfs={**before.rootfs, "c3": "/b/c3/rootfs"})
    assert "c3" not in before.rootfs and after.rootfs["c3"] == "/b/c3/rootfs"


def write(tmp_path: pathlib.Path, data: object) -> str:
    path = tmp_path / STATE_FILE
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


@pytest.mark.parametrize("change, message", [
    (lambda d: "{not json", "not JSON"),
    (lambda d: [d], "no version field"),
    (lambda d: {k: v for k, v in d.items() if k != "plan"}, "missing field plan"),
    (lambda d: {**d, "qemu_pid": "1234"}, "qemu_pid: expected int, not str"),
    (lambda d: {**d, "qemu_pid": True}, "qemu_pid: expected int, not bool"),
    (lambda d: {**d, "surprise": 1}, "unknown field(s) surprise"),
    (lambda d: {**d, "rootfs": {"c": 7}}, "rootfs[c]: expected str"),
    (lambda d: {**d, "plan": {**d["plan"], "vcpus": None}}, "plan: vcpus: expected int"),
    (lambda d: {**d, "cgroup": {**d["cgroup"], "layout": {"pod_cgroup": "/p",
                                                          "sandbox_id": "../x"}}},
     "cgroup: layout: sandbox id '../x' is not a containerd id"),
])
def test_a_malformed_file_is_refused_by_name(tmp_path, change, message) -> None:
    path = write(tmp_path, change(state().to_json()))
    with pytest.raises(PodStateError) as refused:
        PodState.load(path)
    assert str(refused.value).startswith(path + ":") and message in str(refused.value)


@pytest.mark.parametrize("version", [0, VERSION + 1, "1"])
def test_an_unknown_version_is_refused_by_name(tmp_path, version) -> None:
    path = write(tmp_path, {**state().to_json(), "version": version})
    with pytest.raises(PodStateError, match=f"^{path}: pod state version {version!r} is not"):
        PodState.load(path)


@pytest.fixture
def state_root(tmp_path, monkeypatch) -> pathlib.Path:
    monkeypatch.setattr(paths, "STATE_ROOT", str(tmp_path / "run"))
    return tmp_path / "run"


def fake_qemu(marker: str) -> subprocess.Popen:
    """A process that looks like the sandbox's QEMU on its command line."""
    proc = subprocess.Popen(["qemu-system-x86_64", "-c", "import time; time.sleep(60)",
                             f"unix:{marker},server=on,wait=off"], executable=sys.executable)
    deadline = time.monotonic() + 10
    while marker.encode() not in pathlib.Path(f"/proc/{proc.pid}/cmdline").read_bytes():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return proc


def test_delete_with_an_unreadable_state_kills_qemu_and_keeps_the_file(state_root) -> None:
    state_dir = pathlib.Path(paths.state_dir(NS, "sb1"))
    state_dir.mkdir(parents=True)
    path = write(state_dir, {**state().to_json(), "version": VERSION + 1})
    qemu = fake_qemu(str(state_dir / "vm" / "qmp.sock"))
    try:
        with pytest.raises(PodStateError, match=f"^{path}:"):
            cleanup.remove_shim_state(NS, "sb1", None)
        assert qemu.wait(timeout=10) == -9
        assert pathlib.Path(path).exists()  # for whoever can read it
    finally:
        qemu.kill()
        qemu.wait()


def test_delete_finds_qemu_by_the_persisted_qmp_socket(state_root) -> None:
    state_dir = pathlib.Path(paths.state_dir(NS, "sb1"))
    state_dir.mkdir(parents=True)
    qmp = str(state_dir / "elsewhere.sock")
    qemu = fake_qemu(qmp)
    try:
        # Its cgroups never existed: removing them is a no-op.
        state(qmp_socket=qmp, qemu_pid=qemu.pid, qemu_start_time=start_time(qemu.pid),
              rootfs={}, cgroup=CgroupState(cgroups.detect().to_state(),
                                            SandboxLayout("/podvm-podstate-test", "sb1"))
              ).save(state_path(str(state_dir)))
        cleanup.remove_shim_state(NS, "sb1", None)
        assert qemu.wait(timeout=10) == -9
        assert not state_dir.exists()
    finally:
        qemu.kill()
        qemu.wait()


def test_delete_without_a_state_file_removes_the_directory(state_root) -> None:
    state_dir = pathlib.Path(paths.state_dir(NS, "sb1"))
    (state_dir / "vm").mkdir(parents=True)
    cleanup.remove_shim_state(NS, "sb1", None)
    assert not state_dir.exists()


def test_podvmctl_status_names_a_file_it_cannot_read(state_root, capsys) -> None:
    state_dir = pathlib.Path(paths.state_dir(NS, "sb1"))
    state_dir.mkdir(parents=True)
    path = write(state_dir, {**state().to_json(), "version": VERSION + 1})
    assert ctl.main(["status", "sb1"]) == 1
    assert capsys.readouterr().err.startswith(f"podvmctl: {path}: pod state version")


def test_podvmctl_status_says_when_the_recorded_qemu_is_gone(state_root) -> None:
    """A pid that now names another process (a start time that differs) is not QEMU."""
    require_root()
    state_dir = pathlib.Path(paths.state_dir(NS, "sb1"))
    state_dir.mkdir(parents=True)
    layout = SandboxLayout("/podvm-podstate-test", "sb1")
    sandbox = cgroups.SandboxCgroup.create(layout)
    other = subprocess.Popen(["sleep", "60"])
    try:
        state(qemu_pid=other.pid, qemu_start_time=1,
              cgroup=CgroupState(sandbox.manager.to_state(), layout)
              ).save(state_path(str(state_dir)))
        report = status.collect(status.find("sb1"))
        assert report["qemu_pid"] == other.pid
        assert report["plan"]["vcpus"] == state().plan.vcpus
        assert report["vm"]["qemu_memory_mib"] == 2304
        assert report["cgroup"]["pod_cgroup"] == "/podvm-podstate-test"
        assert f"QEMU {other.pid} has exited" in report["differences"]
        assert f"QEMU pid {other.pid}" in status.render(report)
    finally:
        other.kill()
        other.wait()
        sandbox.destroy()
        described = cgroups.detect().to_state()
        for h in described.get("hierarchies", [described]):  # v1, or the one v2 mount
            (pathlib.Path(h["mountpoint"]) / "podvm-podstate-test").rmdir()
