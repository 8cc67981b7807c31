"""Every host thread of a pod's VM in the pod's sandbox cgroup, by role, on this host's
real cgroup v1 hierarchies, and the CPU and memory QEMU uses charged there (docs/design.md,
Sandbox cgroup layout). The same placement on cgroup v2 runs in the guest VM:
tests/cgroups/test_v2_full_host.py.

Where the shim puts a VM's threads, how podvmctl reports them and what `delete` removes
after a crash are the host's: those run on a FakeVM (testbed/fakevm.py: a real process
with QEMU's threads, named as QEMU names them). Threads QEMU itself makes as the guest
does I/O, and what a busy guest's QEMU is charged, need a real QEMU (TCG)."""
from __future__ import annotations

import asyncio
import json
import os
import pathlib
import subprocess
import uuid

import pytest

from podvm_core.pb.containerd.task.v2 import shim_pb2 as api
import cgroups

from testbed.hostcgroup import charged, sandbox_state
from testbed.taskshim import NS, Fifos, busybox_rootfs, call, create, task_shim, workload_bundle

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def rootfs(tmp_path_factory) -> pathlib.Path:
    return busybox_rootfs(tmp_path_factory.mktemp("busybox-rootfs"))


@pytest.fixture
async def pod(tmp_path, rootfs):
    async for ctx in _pod(tmp_path, rootfs, "fake"):
        yield ctx


@pytest.fixture
async def vm_pod(tmp_path, rootfs):
    async for ctx in _pod(tmp_path, rootfs, "qemu"):
        yield ctx


async def _pod(tmp_path, rootfs, vmm: str):
    parent = f"/podvm-cgtest-{uuid.uuid4().hex[:8]}"
    async with task_shim(tmp_path, rootfs, cgroups_path=f"{parent}/sb", vmm=vmm) as ctx:
        ctx["pod_cgroup"] = parent
        ctx["sandbox_cgroup"] = f"{parent}/podvm_sb"
        ctx["qemu_pid"] = sandbox_state()["qemu_pid"]
        yield ctx
    manager = cgroups.detect()
    for h in manager.to_state().get("hierarchies", []):
        sandbox_dir = pathlib.Path(h["mountpoint"]) / parent.strip("/") / "podvm_sb"
        assert not sandbox_dir.exists(), f"{sandbox_dir} left after teardown"
        pod_dir = pathlib.Path(h["mountpoint"]) / parent.strip("/")
        if pod_dir.is_dir():
            pod_dir.rmdir()  # made for the test (kubelet's, in real life)


def threads(pid: int) -> dict[int, tuple[str, dict[str, str]]]:
    """tid -> (name, controller -> cgroup path) for each thread of `pid`."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            name = pathlib.Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            lines = pathlib.Path(f"/proc/{pid}/task/{tid}/cgroup").read_text().splitlines()
        except FileNotFoundError:
            continue  # exited meanwhile
        groups = {}
        for line in lines:
            _, controllers, path = line.split(":", 2)
            for c in controllers.split(","):
                groups[c] = path
        out[int(tid)] = (name, groups)
    return out


SPLIT = ("cpu", "cpuacct", "cpuset")  # controllers vcpus/ and vmm/ exist in
WHOLE = ("memory", "pids", "devices")


def misplaced(pod: dict) -> list[str]:
    """Every thread not exactly where docs/design.md puts it: the empty list when all are."""
    sandbox, wrong = pod["sandbox_cgroup"], []
    for tid, (name, groups) in threads(pod["qemu_pid"]).items():
        child = "vcpus" if name.startswith("CPU ") else "vmm"
        for c in SPLIT:
            if groups.get(c) != f"{sandbox}/{child}":
                wrong.append(f"{tid} {name}: {c} {groups.get(c)}, want {sandbox}/{child}")
        for c in WHOLE:
            if groups.get(c) != sandbox:
                wrong.append(f"{tid} {name}: {c} {groups.get(c)}, want {sandbox}")
    return wrong


async def test_every_qemu_thread_is_in_the_sandbox_cgroup_by_role(pod) -> None:
    found = threads(pod["qemu_pid"])
    names = [name for name, _ in found.values()]
    # Under TCG every vCPU the pod may grow to is plugged at boot (default_maxvcpus 2)
    assert sum(n.startswith("CPU ") for n in names) == 2 and len(names) >= 5, names
    assert misplaced(pod) == []
    # The shim is charged there too (sandbox_cgroup_only = true by default).
    shim_pid = json.loads(pathlib.Path(f"/run/podvm/{NS}/sb/shim.json").read_text())["pid"]
    for c, path in threads(shim_pid)[shim_pid][1].items():
        if c in SPLIT + WHOLE:
            assert path == pod["sandbox_cgroup"], (c, path)


async def test_threads_that_appear_or_move_are_put_back(vm_pod) -> None:
    """QEMU makes threads later (9p I/O workers, hot-plugged vCPUs) in their creator's
    cgroup, and anything may move one: the shim sorts them within seconds."""
    fifos = Fifos(vm_pod["tmp"], "io")
    script = "dd if=/dev/zero of=/f bs=64k count=400 2>/dev/null; sync; echo wrote; sleep 1000"
    await create(vm_pod, "io", workload_bundle(vm_pod, "io", args=["sh", "-c", script]),
                 fifos)
    await call(vm_pod, "Start", api.StartRequest(id="io"), api.StartResponse)
    assert b"wrote" in await fifos.read(fifos.out, b"wrote", timeout=60)
    manager = cgroups.detect()
    layout = cgroups.SandboxLayout(vm_pod["pod_cgroup"], "sb")
    found = threads(vm_pod["qemu_pid"])
    vcpu = next(t for t, (n, _) in found.items() if n.startswith("CPU "))
    other = next(t for t, (n, _) in found.items() if not n.startswith("CPU ") and t != vcpu)
    assert manager.move_thread(layout, "vmm", vcpu) and manager.move_thread(layout, "vcpus",
                                                                             other)
    assert misplaced(vm_pod) != []
    async with asyncio.timeout(10):
        while misplaced(vm_pod):
            await asyncio.sleep(0.2)
    await call(vm_pod, "Kill", api.KillRequest(id="io", signal=9))
    await call(vm_pod, "Wait", api.WaitRequest(id="io"), api.WaitResponse)
    await call(vm_pod, "Delete", api.DeleteRequest(id="io"), api.DeleteResponse)


async def test_busy_pod_is_charged_to_its_sandbox_cgroup(vm_pod) -> None:
    """A container burning CPU and writing files: the sandbox cgroup's CPU usage covers
    all CPU time of QEMU's threads, its memory usage QEMU's anonymous memory."""
    fifos = Fifos(vm_pod["tmp"], "busy")
    script = ("while :; do :; done & "
              "while :; do dd if=/dev/zero of=/f bs=64k count=200 2>/dev/null; sync; done & "
              "echo busy; wait")
    await create(vm_pod, "busy", workload_bundle(vm_pod, "busy", args=["sh", "-c", script]),
                 fifos)
    await call(vm_pod, "Start", api.StartRequest(id="busy"), api.StartResponse)
    assert b"busy" in await fifos.read(fifos.out, b"busy", timeout=60)
    async with asyncio.timeout(120):  # until QEMU has really been busy, however loaded
        while (figures := charged(vm_pod["qemu_pid"],
                                  vm_pod["sandbox_cgroup"]))["qemu_cpu_s"] < 2:
            await asyncio.sleep(0.2)
    print("accounting:", figures)
    assert figures["cgroup_cpu_s"] >= 0.99 * figures["qemu_cpu_s"], figures
    assert figures["cgroup_memory_mib"] >= figures["qemu_anon_mib"], figures
    await call(vm_pod, "Kill", api.KillRequest(id="busy", signal=9, all=True))
    await call(vm_pod, "Wait", api.WaitRequest(id="busy"), api.WaitResponse)
    await call(vm_pod, "Delete", api.DeleteRequest(id="busy"), api.DeleteResponse)


def test_podvmctl_status_shows_every_thread_and_no_difference(pod) -> None:
    out = subprocess.run([str(ROOT / ".venv/bin/podvmctl"), "status", "sb", "--json"],
                         capture_output=True, text=True, check=True).stdout
    report = json.loads(out)
    qemu = {t["tid"]: t for t in report["cgroup"]["threads"] if t["pid"] == pod["qemu_pid"]}
    assert set(qemu) == set(threads(pod["qemu_pid"]))
    assert {t["role"] for t in qemu.values()} >= {"vcpu", "main"}
    assert all(t["location"] == ("vcpus" if t["role"] == "vcpu" else "vmm")
               for t in qemu.values())
    assert report["differences"] == []
    assert report["plan"]["vcpus"] == 1 and report["vm"]["online_cpus"] == 1
    text = subprocess.run([str(ROOT / ".venv/bin/podvmctl"), "status", "sb"],
                          capture_output=True, text=True, check=True).stdout
    assert "CPU 0/TCG" in text and "differences: none" in text
    missing = subprocess.run([str(ROOT / ".venv/bin/podvmctl"), "status", "no-such-pod"],
                             capture_output=True, text=True)
    assert missing.returncode == 1 and "no sandbox 'no-such-pod'" in missing.stderr


async def test_delete_after_a_shim_crash_removes_vm_and_cgroups(tmp_path, rootfs) -> None:
    """`delete` (containerd runs it when a shim is gone) finds QEMU, mounts and the
    sandbox cgroup from sandbox.json alone."""
    from testbed.shimproc import daemon_pid, run_shim

    parent = f"/podvm-cgtest-{uuid.uuid4().hex[:8]}"
    shim = task_shim(tmp_path, rootfs, cgroups_path=f"{parent}/sb", vmm="fake")
    ctx = await shim.__aenter__()
    try:
        qemu_pid = sandbox_state()["qemu_pid"]
        os.kill(daemon_pid(NS, "sb"), 9)
        deleted = run_shim(ctx["bundle"], "sb", "delete", ctx["grpc"], namespace=NS)
        assert deleted.returncode == 0, deleted.stderr
        again = run_shim(ctx["bundle"], "sb", "delete", ctx["grpc"], namespace=NS)
        assert again.returncode == 0, again.stderr  # containerd may run it twice
        assert not pathlib.Path(f"/proc/{qemu_pid}").exists() or \
            " Z " in pathlib.Path(f"/proc/{qemu_pid}/stat").read_text()
        assert not pathlib.Path(f"/run/podvm/{NS}/sb").exists()
        for h in cgroups.detect().to_state()["hierarchies"]:
            pod_dir = pathlib.Path(h["mountpoint"]) / parent.strip("/")
            assert not (pod_dir / "podvm_sb").exists(), pod_dir
            if pod_dir.is_dir():
                pod_dir.rmdir()
    finally:
        try:
            await shim.__aexit__(None, None, None)
        except Exception:
            pass  # the daemon is gone: the harness's own teardown cannot talk to it


async def test_shim_outside_the_sandbox_and_vmm_threads_on_overhead_cpus(tmp_path,
                                                                        rootfs) -> None:
    """sandbox_cgroup_only = false: the shim is charged to its own overhead cgroup;
    overhead_cpus: QEMU's non-vCPU threads run there, the vCPUs keep the pod's CPUs."""
    online = sorted(os.sched_getaffinity(0))
    if len(online) < 2:
        pytest.fail(f"this test needs 2 host CPUs, this machine has {online}")
    parent = f"/podvm-cgtest-{uuid.uuid4().hex[:8]}"
    runtime = {"sandbox_cgroup_only": False, "overhead_cpus": str(online[0])}
    async with task_shim(tmp_path, rootfs, cgroups_path=f"{parent}/sb", runtime=runtime,
                         vmm="fake"):
        shim_pid = json.loads(pathlib.Path(f"/run/podvm/{NS}/sb/shim.json").read_text())["pid"]
        for c, path in threads(shim_pid)[shim_pid][1].items():
            if c in SPLIT + WHOLE:
                assert path == "/podvm_overhead/podvm_sb", (c, path)
        qemu = sandbox_state()["qemu_pid"]
        for tid, (name, groups) in threads(qemu).items():
            assert groups["memory"] == f"{parent}/podvm_sb", (name, groups)
            wanted = set(online) if name.startswith("CPU ") else {online[0]}
            assert os.sched_getaffinity(tid) == wanted, (name, tid)
    for h in cgroups.detect().to_state()["hierarchies"]:
        for d in (pathlib.Path(h["mountpoint"]) / parent.strip("/"),):
            assert not (d / "podvm_sb").exists()
            if d.is_dir():
                d.rmdir()
        assert not (pathlib.Path(h["mountpoint"]) / "podvm_overhead" / "podvm_sb").exists()
