"""One plan for the VM, the sandbox cgroup and Kubernetes' view, through containerd's CRI
(docs/design.md, Resource model): a pod's limits size its VM at boot, `crictl update`
grows the running VM in dynamic mode and is refused in static mode, a pod that cannot
fit is refused at runp and leaves nothing. Real containerd, real QEMU (TCG)."""
from __future__ import annotations

import os
import pathlib
import subprocess

import pytest

from shim.host import paths
from shim.host.podstate import PodState, state_path
from podvmctl import status
from shim.config import MEASURED_OVERHEAD_MIB
from testbed.containerd import CRI_NAMESPACE, Containerd, shims_of
from testbed.cri import Crictl, write_config
from testbed.pods import container_config, pod_config, podvm_leftovers, qemus
from testbed.prereqs import require_root, require_tool
from testbed.vmconfig import guest_image, write_test_config

from .test_crictl import wait_for

MIB = 1 << 20


def start_containerd(workdir: pathlib.Path, image_cache, runtime: dict,
                     **qemu) -> Containerd:
    require_root()
    for tool in ("containerd", "ctr"):
        require_tool(tool, "containerd")
    guest_image()
    config = write_test_config(workdir / "podvm.toml", runtime=runtime, **qemu)
    c = Containerd(workdir / "containerd", namespace="podvm-res-test", cri=True,
                   podvm_config=config)
    c.start()
    try:
        c.import_cri_images(image_cache)
    except BaseException:
        c.stop()
        raise
    return c


@pytest.fixture(scope="module")
def static_ctd(tmp_path_factory, image_cache):
    c = start_containerd(tmp_path_factory.mktemp("podvm-static"), image_cache,
                         {"static_sandbox_resource_mgmt": True}, default_maxvcpus=8,
                         default_maxmemory=2048)
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def dynamic_ctd(tmp_path_factory, image_cache):
    c = start_containerd(tmp_path_factory.mktemp("podvm-dynamic"), image_cache, {},
                         default_maxvcpus=2, default_maxmemory=1024)
    try:
        yield c
    finally:
        c.stop()


def resources(quota: int = 0, memory: int = 0) -> dict:
    return {"cpu_period": 100_000 if quota else 0, "cpu_quota": quota,
            "memory_limit_in_bytes": memory}


def run_pod(ctd: Containerd, tmp: pathlib.Path, name: str, pod_resources: dict | None = None,
            container_resources: dict | None = None) -> tuple[Crictl, str, str, pathlib.Path]:
    crictl = Crictl(ctd.cri_endpoint, timeout="120s")
    pod = pod_config(ctd, tmp, name)
    if pod_resources:
        pod["linux"]["resources"] = pod_resources
    pod_file = write_config(tmp, f"{name}-pod.json", pod)
    pod_id = crictl.runp(pod_file, runtime="podvm")
    container = container_config("c", "sleep 1000")
    if container_resources:
        container["linux"] = {"resources": container_resources}
    cid = crictl.create(pod_id, write_config(tmp, f"{name}-c.json", container), pod_file)
    crictl.start(cid)
    return crictl, pod_id, cid, pod_file


def guest_size(crictl: Crictl, cid: str) -> tuple[int, int]:
    """(online CPUs, MemTotal MiB) inside the guest."""
    nproc = crictl.exec(cid, "nproc")
    mem = crictl.exec(cid, "sh", "-c", "grep MemTotal /proc/meminfo")
    assert nproc.exit_code == 0 and mem.exit_code == 0, (nproc, mem)
    return int(nproc.stdout.strip()), int(mem.stdout.split()[1]) // 1024


def remove_pod(ctd: Containerd, crictl: Crictl, pod_id: str) -> None:
    crictl.run("stopp", pod_id)
    crictl.run("rmp", pod_id)
    assert podvm_leftovers(ctd, pod_id) == []


def test_static_pod_is_sized_at_boot_and_refuses_growth(static_ctd, tmp_path) -> None:
    """2.5 CPU and 512 MiB with defaults 1 vCPU / 256 MiB: 4 vCPUs and 768 MiB."""
    crictl, pod_id, cid, _ = run_pod(static_ctd, tmp_path, "static",
                                     resources(250_000, 512 * MIB),
                                     resources(250_000, 512 * MIB))
    try:
        cpus, mem = guest_size(crictl, cid)
        assert cpus == 4
        assert 768 - 64 <= mem <= 768  # MemTotal: the VM's memory less the kernel's own
        report = status.collect(status.find(pod_id, CRI_NAMESPACE))
        assert (report["plan"]["vcpus"], report["plan"]["memory_mib"]) == (4, 768)
        assert (report["vm"]["qemu_vcpus"], report["vm"]["qemu_memory_mib"]) == (4, 768)
        # Kubernetes' view (limits + the overhead the plan declares) is what the host gives
        host_mib = 768 + MEASURED_OVERHEAD_MIB["tcg"]
        assert status.kubernetes_view(report["plan"]) == {"cpus": 3.5, "memory_mib": host_mib}
        assert report["cgroup"]["limits"]["memory_limit_bytes"] == host_mib * MIB
        assert report["differences"] == []
        grow = crictl.run("update", "--cpu-period", "100000", "--cpu-quota", "400000", cid,
                          check=False)
        assert grow.returncode != 0
        assert "static_sandbox_resource_mgmt" in grow.stderr and "5 vCPUs" in grow.stderr
        # What fits in the VM is applied all the same: the quota grows to its 4 vCPUs.
        assert "applied what fits" in grow.stderr
        report = status.collect(status.find(pod_id, CRI_NAMESPACE))
        assert report["cgroup"]["limits"]["cpu_quota_us"] == 400_000
        grow = crictl.run("update", "--memory", str(1024 * MIB), cid, check=False)
        assert grow.returncode != 0 and "1280 MiB" in grow.stderr
        assert guest_size(crictl, cid) == (cpus, mem)  # nothing changed
        # What fits within the boot size is applied: the sandbox cgroup follows.
        crictl.run("update", "--cpu-period", "100000", "--cpu-quota", "150000", cid)
        report = status.collect(status.find(pod_id, CRI_NAMESPACE))
        assert report["plan"]["vcpus"] == 4
        assert report["cgroup"]["limits"]["cpu_quota_us"] == 350_000  # 2.5 + 1 guest vCPU
        assert report["differences"] == []
    finally:
        remove_pod(static_ctd, crictl, pod_id)


def test_dynamic_update_grows_the_running_vm(dynamic_ctd, tmp_path) -> None:
    crictl, pod_id, cid, pod_file = run_pod(dynamic_ctd, tmp_path, "dynamic")
    try:
        cpus, mem = guest_size(crictl, cid)
        assert cpus == 1
        crictl.run("update", "--cpu-period", "100000", "--cpu-quota", "100000",
                   "--memory", str(256 * MIB), cid)
        grown = wait_for("the guest to see a second vCPU and more memory",
                         lambda: (g := guest_size(crictl, cid))[0] == 2 and g, timeout=90)
        assert grown[1] >= mem + 256
        report = status.collect(status.find(pod_id, CRI_NAMESPACE))
        assert (report["plan"]["vcpus"], report["plan"]["memory_mib"]) == (2, 512)
        limits = report["cgroup"]["limits"]
        assert limits["cpu_quota_us"] == 200_000  # 1 CPU of workload + the guest's own
        assert limits["memory_limit_bytes"] == report["plan"]["cgroup_memory_limit"]
        assert report["differences"] == []
        # The container goes: its vCPU is unplugged, its memory stays (never taken back).
        crictl.run("stop", "-t", "0", cid)
        crictl.run("rm", cid)
        report = wait_for("the hot-added vCPU to go", lambda: (r := status.collect(
            status.find(pod_id, CRI_NAMESPACE)))["plan"]["vcpus"] == 1 and r)
        assert report["vm"]["online_cpus"] == 1 and report["plan"]["memory_mib"] == 512
    finally:
        remove_pod(dynamic_ctd, crictl, pod_id)


def test_pod_that_cannot_fit_is_refused_at_runp_and_leaves_nothing(dynamic_ctd,
                                                                  tmp_path) -> None:
    crictl = Crictl(dynamic_ctd.cri_endpoint, timeout="120s")
    before = (len(shims_of(dynamic_ctd.address)), len(qemus(dynamic_ctd.cgroup_parent)),
              sorted(os.listdir(os.path.join(paths.STATE_ROOT, CRI_NAMESPACE)))
              if os.path.isdir(os.path.join(paths.STATE_ROOT, CRI_NAMESPACE)) else [])
    pod = pod_config(dynamic_ctd, tmp_path, "huge")
    pod["linux"]["resources"] = resources(100_000, 64 * 1024 * MIB)
    refused = crictl.run("runp", "--runtime", "podvm",
                         str(write_config(tmp_path, "huge.json", pod)), check=False)
    assert refused.returncode != 0
    assert "MiB of VM memory" in refused.stderr and "1024 MiB" in refused.stderr
    after = (len(shims_of(dynamic_ctd.address)), len(qemus(dynamic_ctd.cgroup_parent)),
             sorted(os.listdir(os.path.join(paths.STATE_ROOT, CRI_NAMESPACE)))
             if os.path.isdir(os.path.join(paths.STATE_ROOT, CRI_NAMESPACE)) else [])
    wait_for("the refused pod's shim to go", lambda: (
        len(shims_of(dynamic_ctd.address)), len(qemus(dynamic_ctd.cgroup_parent))) == before[:2])
    assert after[2] == before[2]


def test_a_pod_beyond_the_vcpu_cap_runs_capped_with_its_quota(dynamic_ctd, tmp_path) -> None:
    """Kubernetes admits a 1.5 CPU limit on a 2-CPU node: the VM (at most 2 vCPUs here)
    gets 2 vCPUs instead of 1 + 1.5 rounded up, the sandbox cgroup the pod's quota plus
    the guest's own; an update asking for more gets the cap and the quota it asked."""
    crictl, pod_id, cid, _ = run_pod(dynamic_ctd, tmp_path, "capped", resources(150_000),
                                     resources(150_000))
    try:
        assert guest_size(crictl, cid)[0] == 2
        report = status.collect(status.find(pod_id, CRI_NAMESPACE))
        plan = report["plan"]
        assert (plan["vcpus"], plan["uncapped_vcpus"], plan["max_vcpus"]) == (2, 3, 2)
        assert report["cgroup"]["limits"]["cpu_quota_us"] == 250_000  # 1.5 + the guest's 1
        assert "capped from 3: at most 2" in status.render(report)
        assert report["differences"] == []
        crictl.run("update", "--cpu-period", "100000", "--cpu-quota", "250000", cid)
        report = status.collect(status.find(pod_id, CRI_NAMESPACE))
        assert (report["plan"]["vcpus"], report["plan"]["uncapped_vcpus"]) == (2, 4)
        assert report["cgroup"]["limits"]["cpu_quota_us"] == 350_000
        assert guest_size(crictl, cid)[0] == 2
        assert report["differences"] == []
    finally:
        remove_pod(dynamic_ctd, crictl, pod_id)


def oom_container(name: str, command: list[str]) -> dict:
    """A container limited to 64 MiB that runs `command`."""
    container = container_config(name, "")
    container["command"] = command
    container["linux"] = {"resources": resources(memory=64 * MIB)}
    return container


# busybox dd allocates its whole block and /dev/zero fills it: 128 MiB cannot fit in 64.
HOG = ["dd", "if=/dev/zero", "of=/dev/null", "bs=128M", "count=1"]


def test_an_oom_kill_reads_as_oomkilled(dynamic_ctd, tmp_path) -> None:
    """The guest's OOM killer kills the container's own process (dd is the container's
    command), or a process it started: `crictl inspect` says OOMKilled either way, as it
    does for runc pods, even though containerd removes the container's task (and the
    guest its cgroup) as soon as it hears of the exit; the TaskOOM comes before the
    TaskExit, as containerd's runc shim sends them."""
    crictl = Crictl(dynamic_ctd.cri_endpoint, timeout="120s")
    pod = pod_config(dynamic_ctd, tmp_path, "oom")
    pod["linux"]["resources"] = resources(memory=128 * MIB)
    pod_file = write_config(tmp_path, "oom-pod.json", pod)
    pod_id = crictl.runp(pod_file, runtime="podvm")
    events = subprocess.Popen(["ctr", "--address", dynamic_ctd.address, "events"],
                              stdout=subprocess.PIPE, text=True)
    try:
        shapes = {"init": HOG, "child": ["sh", "-c", " ".join(HOG) + "; exit 3"]}
        ids = {}
        for name, command in shapes.items():
            ids[name] = crictl.create(pod_id, write_config(
                tmp_path, f"oom-{name}.json", oom_container(name, command)), pod_file)
            crictl.start(ids[name])
        for name, cid in ids.items():
            state = wait_for(f"{name} to exit", lambda: (s := crictl.inspect(cid)["status"])[
                "state"] == "CONTAINER_EXITED" and s, timeout=120)
            assert (state["reason"], state["exitCode"]) == \
                ("OOMKilled", 137 if name == "init" else 3), (name, state)
        # counted in sandbox.json for the node's metrics (podvm_node/monitor.py)
        recorded = PodState.load(state_path(paths.state_dir(CRI_NAMESPACE, pod_id)))
        assert recorded.guest_oom_kills == len(ids)
        events.terminate()
        published = events.communicate(timeout=30)[0].splitlines()
        for name, cid in ids.items():
            topics = [t for line in published if cid in line
                      for t in ("/tasks/oom", "/tasks/exit") if f" {t} " in line]
            assert topics[:2] == ["/tasks/oom", "/tasks/exit"], (name, published)
    finally:
        events.kill()
        events.wait()
        remove_pod(dynamic_ctd, crictl, pod_id)
