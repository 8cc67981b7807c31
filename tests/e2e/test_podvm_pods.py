"""Pods in VMs through containerd's CRI: podvm as a user of crictl sees it.

Real containerd (Debian's 1.6), real QEMU under TCG, the real guest image. Every test
runs with the real crictl too: CRICTL=/path/to/crictl. Here every pod boots its guest
(enable_template = false): the other end-to-end modules' pods mostly restore templates.
What the host makes of a container's exit and of a VM that dies (exit codes, stops, the
shim's word on how the VM ended, cleanup) runs on a FakeVM (testbed/fakevm.py) through
the same containerd and shim: a containerd of its own whose shims make FakeVMs.
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import stat
import threading
import time

import pytest

from shim.host import paths
from shim.host.podstate import PodState, state_path
from testbed.containerd import (CRI_NAMESPACE, Containerd, in_mount_namespace, mount_namespace,
                                mounts_under, shims_of)
from testbed.cri import Crictl, write_config
from testbed.pods import (container_config, pod_config, pod_processes, pod_qemus, podvm_leftovers,
                          qemus)
from testbed.prereqs import require_root, require_tool
from testbed.vmconfig import GUEST, guest_image, vmm_config, write_test_config
from tests.podvm_node.test_monitor import Monitor, by_sandbox

from .test_crictl import wait_for

def guest_kernel() -> str:
    return json.loads((GUEST / "manifest.json").read_text())["kernel_release"]


def scratch_disk(qemu: int, size_mib: int) -> str:
    """The /proc path of the pod's scratch disk in `qemu`'s descriptors: the one regular
    file of `size_mib` it holds (by the descriptor it was given and by its own O_DIRECT
    one, both the same file; unnamed, or named once in the pod's log directory, where
    kubelet counts it: shim/host/podlogdisk.py)."""
    held = {}
    for fd in os.listdir(f"/proc/{qemu}/fd"):
        path = f"/proc/{qemu}/fd/{fd}"
        try:
            st = os.stat(path)
        except FileNotFoundError:
            continue  # closed meanwhile: not the disk, which QEMU holds for the VM's life
        if stat.S_ISREG(st.st_mode) and st.st_nlink <= 1 and st.st_size == size_mib << 20:
            held[(st.st_dev, st.st_ino)] = path
    assert len(held) == 1, f"QEMU {qemu} holds {len(held)} disks of {size_mib} MiB"
    return next(iter(held.values()))


def pod_mount_namespaces(ctd: Containerd, pod_id: str) -> set[str]:
    """The mount namespaces of the pod's processes other than the host's."""
    return {ns for ns in map(mount_namespace, pod_processes(ctd, pod_id))
            if ns is not None and ns != mount_namespace()}


def cri_containerd(tmp_path_factory, image_cache, name: str, namespace: str,
                   vmm: str = "qemu", **qemu):
    """A fixture's body: a CRI containerd of its own with the test images and podvm
    configured by `qemu` keys, its pods' VMs made by `vmm` (testbed/vmconfig.py VMMS);
    afterwards nothing of it may be left."""
    require_root()
    for tool in ("containerd", "ctr"):
        require_tool(tool, "containerd")
    guest_image()
    workdir = tmp_path_factory.mktemp(name)
    config = write_test_config(workdir / "podvm.toml", **{**vmm_config(vmm), **qemu})
    c = Containerd(workdir / "containerd", namespace=namespace, cri=True,
                   podvm_config=config, vmm=vmm)
    c.start()
    try:
        c.import_cri_images(image_cache)
        yield c
    finally:
        c.stop()
    assert c.forced == [], f"stop() had to force: {c.forced}"
    assert shims_of(c.address) == [] and qemus(c.cgroup_parent) == []
    assert mounts_under(c.workdir) == []


@pytest.fixture(scope="module")
def ctd(tmp_path_factory, image_cache):
    yield from cri_containerd(tmp_path_factory, image_cache, "podvm-cri", "podvm-vm-test",
                              enable_template=False)


@pytest.fixture(scope="module")
def crictl(ctd) -> Crictl:
    return Crictl(ctd.cri_endpoint, timeout="120s")


@pytest.fixture(scope="module")
def fake_ctd(tmp_path_factory, image_cache):
    yield from cri_containerd(tmp_path_factory, image_cache, "podvm-cri-fake",
                              "podvm-fake-test", vmm="fake")


@pytest.fixture(scope="module")
def fake_crictl(fake_ctd) -> Crictl:
    return Crictl(fake_ctd.cri_endpoint, timeout="120s")


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> pathlib.Path:
    return tmp_path_factory.mktemp("podvm-configs")


def runp(crictl: Crictl, ctd, configs, name: str) -> tuple[str, pathlib.Path]:
    pod_file = write_config(configs, f"pod-{name}.json", pod_config(ctd, configs, name))
    return crictl.runp(pod_file, runtime="podvm"), pod_file


def start_container(crictl, configs, pod_id, pod_file, name, script) -> str:
    cfile = write_config(configs, f"{name}-c.json", container_config(name, script))
    cid = crictl.create(pod_id, cfile, pod_file)
    crictl.start(cid)
    return cid


def remove_pod(crictl: Crictl, pod_id: str) -> None:
    crictl.run("stopp", pod_id, check=False)
    crictl.run("rmp", pod_id, check=False)


@pytest.fixture(scope="module")
def fake_pod(fake_ctd, fake_crictl, configs):
    pod_id, pod_file = runp(fake_crictl, fake_ctd, configs, "fake-one")
    try:
        yield {"id": pod_id, "file": pod_file}
    finally:
        remove_pod(fake_crictl, pod_id)


@pytest.fixture(scope="module")
def pod(ctd, crictl, configs):
    started = time.monotonic()
    pod_id, pod_file = runp(crictl, ctd, configs, "vm-two")
    ready = time.monotonic() - started
    try:
        ids = {name: start_container(crictl, configs, pod_id, pod_file, name,
                                     f"echo hello-from-{name} on $(uname -r); sleep 1000")
               for name in ("a", "b")}
        yield {"id": pod_id, "file": pod_file, "ready_s": ready, **ids}
    finally:
        remove_pod(crictl, pod_id)


def test_two_containers_log_from_the_guest_kernel(crictl, pod) -> None:
    kernel = guest_kernel()
    assert kernel != os.uname().release
    for name in ("a", "b"):
        wait_for(f"{name}'s log", lambda: crictl.logs(pod[name]).stdout
                 == f"hello-from-{name} on {kernel}\n", timeout=60)
    print(f"runp to ready: {pod['ready_s']:.2f}s")


def test_pod_is_one_vm(crictl, pod) -> None:
    assert len(pod_qemus(pod["id"])) == 1
    assert crictl.inspectp(pod["id"])["status"]["state"] == "SANDBOX_READY"
    for name in ("a", "b"):
        assert crictl.inspect(pod[name])["status"]["state"] == "CONTAINER_RUNNING"


def test_exec_output_and_exit_code(crictl, pod) -> None:
    ok = crictl.exec(pod["a"], "echo", "hi")
    assert (ok.exit_code, ok.stdout) == (0, "hi\n")
    failed = crictl.exec(pod["b"], "sh", "-c", "echo err >&2; exit 3")
    assert failed.exit_code == 3 and "err" in failed.stderr
    uname = crictl.exec(pod["a"], "uname", "-r")
    assert uname.stdout.strip() == guest_kernel()


def test_the_pod_s_pid_1_reaps_orphans(crictl, pod) -> None:
    """No pause image runs in the VM: the agent's namespace holder is the pod's PID 1
    and, like pause, reaps what the pod's processes orphan."""
    pid1 = crictl.exec(pod["a"], "sh", "-c", "tr '\\0' ' ' < /proc/1/cmdline")
    assert "busybox sh -c trap" in pid1.stdout
    orphan = crictl.exec(pod["a"], "sh", "-c", "(sleep 0.3 &); sleep 2; "
                         "grep -l '^State:.*Z' /proc/[0-9]*/status | wc -l")
    assert orphan.exit_code == 0 and orphan.stdout.strip() == "0", orphan


def test_stats_come_from_the_guest(crictl, pod) -> None:
    stats = crictl.run("stats", "-o", "json").json()["stats"]
    by_id = {s["attributes"]["id"]: s for s in stats}
    assert int(by_id[pod["a"]]["memory"]["workingSetBytes"]["value"]) > 0


def test_the_node_monitor_serves_the_running_pod(pod, tmp_path) -> None:
    """`podvm-node monitor` (podvm_node/monitor.py) on this pod's real state: the
    sandbox.json its shim wrote, its cgroup, its QEMU's and virtiofsd's threads."""
    state = PodState.load(state_path(paths.state_dir(CRI_NAMESPACE, pod["id"])))
    monitor = Monitor(tmp_path)
    try:
        samples = monitor.samples()
    finally:
        status, _ = monitor.stop()
    assert status == 0, monitor.log.read_text()

    def value(name: str) -> float:
        return by_sandbox(samples, name)[pod["id"]]

    labels = next(s.labels for s in samples["podvm_sandbox_running"]
                  if s.labels["sandbox_id"] == pod["id"])
    assert (labels["pod"], labels["namespace"]) == ("vm-two", "podvm-test")
    assert value("podvm_sandbox_running") == 1 and value("podvm_sandbox_restored") == 0
    assert state.vm is not None
    assert value("podvm_sandbox_plan_vcpus") == state.plan.vcpus
    assert value("podvm_sandbox_guest_online_vcpus") == state.vm.online_cpus
    assert value("podvm_sandbox_guest_memory_total_bytes") == state.vm.memory_total_mib << 20
    assert 0 < value("podvm_sandbox_boot_seconds") < 120
    assert 0 < value("podvm_sandbox_agent_rtt_seconds") < 5
    assert value("podvm_sandbox_memory_charged_bytes") > 16 << 20  # the guest's RAM touched
    cpu = {s.labels["role"]: s.value for s in samples["podvm_sandbox_vmm_cpu_seconds_total"]
           if s.labels["sandbox_id"] == pod["id"]}
    assert cpu["vcpu"] > 0 and cpu["main"] > 0 and "files" in cpu, cpu
    assert value("podvm_sandbox_guest_oom_kills_total") == 0
    assert value("podvm_sandbox_host_oom_kills_total") == 0  # read from memory.oom_control
    print(f"boot {value('podvm_sandbox_boot_seconds'):.2f}s, agent round trip "
          f"{value('podvm_sandbox_agent_rtt_seconds') * 1000:.2f} ms")


def test_exit_code_7_and_stop_gives_137(fake_crictl, configs, fake_pod) -> None:
    crictl, pod = fake_crictl, fake_pod  # exit codes as the shim reports them: the host's
    seven = start_container(crictl, configs, pod["id"], pod["file"], "seven", "exit 7")
    status = wait_for("exit", lambda: (s := crictl.inspect(seven)["status"])["state"]
                      == "CONTAINER_EXITED" and s, timeout=60)
    assert status["exitCode"] == 7
    sleeper = start_container(crictl, configs, pod["id"], pod["file"], "sleeper", "sleep 1000")
    crictl.run("stop", "-t", "0", sleeper)
    status = crictl.inspect(sleeper)["status"]
    assert (status["state"], status["exitCode"]) == ("CONTAINER_EXITED", 137)
    exec_in_stopped = crictl.exec(sleeper, "true")
    assert exec_in_stopped.exit_code != 0
    for cid in (seven, sleeper):
        crictl.run("rm", cid)
        assert cid not in crictl.ps("-a")
        assert not (pathlib.Path(paths.state_dir(CRI_NAMESPACE, pod["id"])) / "shared"
                    / cid).exists()


def test_stopping_a_container_that_has_just_exited_succeeds(fake_crictl, configs,
                                                            fake_pod) -> None:
    """Between a process's exit in the guest and containerd hearing of it, a stop must
    not fail: kubelet would see a failed stop of a finished container."""
    crictl, pod = fake_crictl, fake_pod
    for i in range(3):
        cid = start_container(crictl, configs, pod["id"], pod["file"], f"quick-{i}", "exit 0")
        stopped = crictl.run("stop", cid, check=False)
        assert stopped.returncode == 0, stopped.stderr
        # A stop answered "already finished" returns before containerd has handled the
        # exit event: the state follows (later on a busy machine).
        wait_for(f"{cid} to read exited",
                 lambda: crictl.inspect(cid)["status"]["state"] == "CONTAINER_EXITED")
        crictl.run("rm", cid)


def test_stop_and_remove_leave_nothing(ctd, crictl, configs) -> None:
    pod_id, pod_file = runp(crictl, ctd, configs, "vm-gone")
    cid = start_container(crictl, configs, pod_id, pod_file, "gone", "sleep 1000")
    # it is all there while the pod runs: its mounts in its own mount namespace only
    left = podvm_leftovers(ctd, pod_id)
    shared = os.path.join(paths.state_dir(CRI_NAMESPACE, pod_id), "shared", cid, "rootfs")
    assert any(m.startswith(f"mount {shared} in pid ") for m in left), left
    assert not [m for m in mounts_under(pathlib.Path(paths.STATE_ROOT)) if pod_id in m]
    shim, = (pid for pid, cmd in shims_of(ctd.address) if pod_id in cmd)
    assert [m for m in mounts_under(ctd.state, shim) if m.endswith(f"{cid}/rootfs")]
    assert not [m for m in mounts_under(ctd.workdir) if cid in m]
    namespaces = pod_mount_namespaces(ctd, pod_id)
    # the shim's, and QEMU's own (its jail: shim/vm/qemu/jail.py), not the host's
    assert len(namespaces) == 2, namespaces
    remove_pod(crictl, pod_id)
    assert pod_id not in crictl.pods()
    wait_for("the pod's shim to exit", lambda: podvm_leftovers(ctd, pod_id) == [], timeout=60)
    # nothing can hold a mount of the pod: no process is left in its namespaces
    assert [in_mount_namespace(ns) for ns in namespaces] == [[], []]


def test_a_guest_that_dies(fake_ctd, fake_crictl, configs) -> None:
    """A FakeVM killed as QEMU would be: what the shim and containerd make of it."""
    ctd, crictl = fake_ctd, fake_crictl
    pod_id, pod_file = runp(crictl, ctd, configs, "vm-dies")
    cid = start_container(crictl, configs, pod_id, pod_file, "victim", "sleep 1000")
    [vm] = pod_qemus(pod_id)
    os.kill(vm, signal.SIGKILL)
    status = wait_for("the container to be reported exited",
                      lambda: (s := crictl.inspect(cid)["status"])["state"]
                      == "CONTAINER_EXITED" and s, timeout=90)
    assert status["exitCode"] == 255
    said = f"(pid {vm}) of sandbox {pod_id} was killed by signal SIGKILL while the pod was running"
    try:
        wait_for("the shim to say how QEMU ended, in containerd's log", lambda: said in ctd.log())
    except AssertionError as exc:  # what the shim did say, for whoever reads the failure
        shim = [line for line in ctd.log().splitlines() if pod_id in line and "podvm" in line]
        raise AssertionError(f"{exc}; the shim's last lines:\n" + "\n".join(shim[-25:])) from None
    refused = crictl.exec(cid, "true")
    assert refused.exit_code != 0
    remove_pod(crictl, pod_id)
    wait_for("the dead pod to be cleaned up", lambda: podvm_leftovers(ctd, pod_id) == [],
             timeout=60)


def runp_refused(crictl: Crictl, ctd, configs, name: str, **extra) -> str:
    """runp that must fail: crictl's error output."""
    pod_file = write_config(configs, f"pod-{name}.json", pod_config(ctd, configs, name,
                                                                   **extra))
    refused = crictl.run("runp", "--runtime", "podvm", str(pod_file), check=False)
    assert refused.returncode != 0, refused.stdout
    return refused.stderr


def running(ctd) -> tuple:
    """What this test containerd's pods hold on the host now."""
    return (sorted(qemus(ctd.cgroup_parent)), sorted(shims_of(ctd.address)),
            sorted(mounts_under(ctd.workdir)))


def nothing_of_failed_pods_left(ctd, before: tuple) -> None:
    wait_for("failed pods to leave nothing", lambda: running(ctd) == before, timeout=60)


def test_a_qemu_that_aborts_at_start_is_refused_in_its_own_words(ctd, crictl, configs,
                                                                 tmp_path) -> None:
    """QEMU exits at once (here: a kernel it cannot load, as real as KVM's `failed to set
    MSR` abort): runp answers podvm's error with QEMU's own last words, the setting and
    the file to change, and nothing is left."""
    junk = tmp_path / "not-a-kernel"
    junk.write_bytes(bytes(range(256)) * 16)
    config = pathlib.Path(ctd.podvm_config)
    good = config.read_text()
    write_test_config(config, kernel=str(junk))  # read by the shim at each sandbox's Create
    before = running(ctd)
    try:
        error = runp_refused(crictl, ctd, configs, "vm-aborts")
    finally:
        config.write_text(good)
    assert "exited with status 1 before the guest came up" in error, error
    assert re.search(r"QEMU said: qemu[\w-]*: \S", error), error  # QEMU's own words
    assert f'accel = "tcg" in {config}' in error, error
    nothing_of_failed_pods_left(ctd, before)


def test_a_qemu_killed_while_booting_is_named(ctd, crictl, configs) -> None:
    before = running(ctd)
    killed: list[int] = []

    def kill_the_new_qemu() -> None:
        deadline = time.monotonic() + 120
        while not killed and time.monotonic() < deadline:
            for pid in set(qemus(ctd.cgroup_parent)) - set(before[0]):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            time.sleep(0.01)

    killer = threading.Thread(target=kill_the_new_qemu)
    killer.start()
    try:
        error = runp_refused(crictl, ctd, configs, "vm-killed")
    finally:
        killer.join()
    assert killed, "no QEMU appeared"
    assert "was killed by signal SIGKILL before the guest came up" in error, error
    assert "QEMU said:" in error and "guest console ends with:" in error, error
    nothing_of_failed_pods_left(ctd, before)


def test_a_host_network_pod_is_refused_before_anything_boots(ctd, crictl, configs) -> None:
    """hostNetwork: true through the CRI (namespace option NODE): refused with what to do,
    no VM booted, nothing left; the same pod on the POD network runs (test above)."""
    before = running(ctd)
    node = {"cgroup_parent": ctd.cgroup_parent,
            "security_context": {"namespace_options": {"network": 2, "pid": 2}}}
    error = runp_refused(crictl, ctd, configs, "on-host", linux=node)
    assert "hostNetwork: true" in error and "hostPID: true" in error, error
    assert "run it with runc" in error, error
    assert "QEMU" not in error, error
    nothing_of_failed_pods_left(ctd, before)
