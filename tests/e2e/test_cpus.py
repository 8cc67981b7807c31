"""CPU affinity and reservations through containerd's CRI (docs/design.md, CPUs):
a pod's vCPU threads stay on the CPUs its containers' cpusets give, pinned 1:1 when
asked, containers confined in the guest to the vCPUs of their own CPUs, and exclusive
CPUs from the node-wide allocator. Real containerd, real QEMU (TCG), real cgroups."""
from __future__ import annotations

import json
import os
import pathlib
import signal

import pytest

from shim.host import paths
from podvmctl import status
from shim.cpus.allocator import Allocator, start_time
from shim.cpus.cpuset import format_cpu_list
from testbed.containerd import CRI_NAMESPACE, Containerd
from testbed.cri import Crictl, write_config
from testbed.pods import container_config, pod_config
from testbed.prereqs import require

from .test_crictl import wait_for
from .test_pod_resources import remove_pod, start_containerd

ONLINE = sorted(Allocator().pool)

# The exclusive test boots one VM per CPU it can reserve, plus one: on a big node the
# lowest CPUs are reserved for the system (reserved_cpus) so that at most MAX_EXCLUSIVE
# are given out, as on a node with kubelet's --reserved-cpus.
MAX_EXCLUSIVE = 3
RESERVED = format_cpu_list(ONLINE[:-MAX_EXCLUSIVE]) if len(ONLINE) > MAX_EXCLUSIVE else ""


def need_two_cpus() -> None:
    """Two distinct host CPUs: a pod's vCPUs on one of them, or one on each."""
    require(len(ONLINE) >= 2, f"2 online host CPUs (this machine has "
                              f"{format_cpu_list(ONLINE)})")


PLUGGED = 2
"""vCPU threads of a pod: default_maxvcpus, as under TCG every vCPU is plugged at boot
(the offline ones asleep, confined like the others)."""


@pytest.fixture(scope="module")
def pinning_ctd(tmp_path_factory, image_cache):
    c = start_containerd(tmp_path_factory.mktemp("podvm-pinning"), image_cache,
                         {"enable_vcpus_pinning": True}, default_maxvcpus=2)
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def exclusive_ctd(tmp_path_factory, image_cache):
    c = start_containerd(tmp_path_factory.mktemp("podvm-exclusive"), image_cache,
                         {"cpu_reservation": "exclusive", "reserved_cpus": RESERVED},
                         default_maxvcpus=2)
    try:
        yield c
    finally:
        c.stop()


def vcpu_affinities(pod_id: str) -> list[set[int]]:
    """sched_getaffinity of the pod's vCPU threads, in vCPU order."""
    report = status.collect(status.find(pod_id, CRI_NAMESPACE))
    vcpus = sorted((t for t in report["cgroup"]["threads"] if t["role"] == "vcpu"),
                   key=lambda t: int(t["name"].split()[1].split("/")[0]))
    return [os.sched_getaffinity(t["tid"]) for t in vcpus]


def start(crictl: Crictl, tmp: pathlib.Path, pod_id: str, pod_file: pathlib.Path, name: str,
          **linux_resources) -> str:
    config = container_config(name, "sleep 1000")
    if linux_resources:
        config["linux"] = {"resources": linux_resources}
    cid = crictl.create(pod_id, write_config(tmp, f"{name}.json", config), pod_file)
    crictl.start(cid)
    return cid


def guest_affinity(crictl: Crictl, cid: str) -> str:
    result = crictl.exec(cid, "sh", "-c", "grep Cpus_allowed_list /proc/self/status")
    assert result.exit_code == 0, result
    return result.stdout.split()[-1]


def test_cpuset_of_a_container_bounds_every_vcpu_thread(pinning_ctd, tmp_path) -> None:
    need_two_cpus()
    crictl = Crictl(pinning_ctd.cri_endpoint, timeout="120s")
    pod_file = write_config(tmp_path, "pod.json", pod_config(pinning_ctd, tmp_path, "cpuset"))
    pod_id = crictl.runp(pod_file, runtime="podvm")
    try:
        assert all(a == set(ONLINE) for a in vcpu_affinities(pod_id))
        cid = start(crictl, tmp_path, pod_id, pod_file, "one", cpuset_cpus=str(ONLINE[1]))
        assert vcpu_affinities(pod_id) == [{ONLINE[1]}] * PLUGGED
        report = status.collect(status.find(pod_id, CRI_NAMESPACE))
        assert report["cgroup"]["limits"]["cpuset_cpus"] == str(ONLINE[1])
        wide = f"{ONLINE[0]},{ONLINE[1]}"
        crictl.run("update", "--cpuset-cpus", wide, cid)
        assert vcpu_affinities(pod_id) == [set(ONLINE[:2])] * PLUGGED
        crictl.run("update", "--cpuset-cpus", str(ONLINE[1]), cid)
        crictl.run("stop", "-t", "0", cid)
        crictl.run("rm", cid)
        wait_for("the pod's CPUs back", lambda: vcpu_affinities(pod_id) == [set(ONLINE)] * PLUGGED)
    finally:
        remove_pod(pinning_ctd, crictl, pod_id)


def test_vcpus_pinned_and_containers_confined_in_the_guest(pinning_ctd, tmp_path) -> None:
    """Two containers on disjoint CPUs: two vCPUs, one pinned on each CPU, and inside the
    guest each container runs only on the vCPU of its own CPU (kata-containers#5050)."""
    need_two_cpus()
    a_cpu, b_cpu = ONLINE[0], ONLINE[1]
    crictl = Crictl(pinning_ctd.cri_endpoint, timeout="120s")
    pod_file = write_config(tmp_path, "pod.json", pod_config(pinning_ctd, tmp_path, "pin"))
    pod_id = crictl.runp(pod_file, runtime="podvm")
    try:
        half = {"cpu_period": 100_000, "cpu_quota": 50_000}
        a = start(crictl, tmp_path, pod_id, pod_file, "a", cpuset_cpus=str(a_cpu), **half)
        b = start(crictl, tmp_path, pod_id, pod_file, "b", cpuset_cpus=str(b_cpu), **half)
        assert vcpu_affinities(pod_id) == [{a_cpu}, {b_cpu}]  # 1 + 0.5 + 0.5 = 2 vCPUs
        assert guest_affinity(crictl, a) == "0" and guest_affinity(crictl, b) == "1"
        crictl.run("update", "--cpuset-cpus", f"{a_cpu},{b_cpu}", b)
        assert guest_affinity(crictl, b) == "0-1" and guest_affinity(crictl, a) == "0"
    finally:
        remove_pod(pinning_ctd, crictl, pod_id)


def exclusive_pod(ctd: Containerd, tmp: pathlib.Path, crictl: Crictl, name: str):
    pod = pod_config(ctd, tmp, name)
    pod["linux"]["resources"] = {"cpu_period": 100_000, "cpu_quota": 100_000,
                                 "cpu_shares": 1024}  # requests = limits = 1 CPU
    return crictl.run("runp", "--runtime", "podvm", str(write_config(tmp, f"{name}.json", pod)),
                      check=False)


def pod_cpuset(pod_id: str) -> str:
    return status.collect(status.find(pod_id, CRI_NAMESPACE))["cgroup"]["limits"]["cpuset_cpus"]


def shim_pid(pod_id: str) -> int:
    state = pathlib.Path(paths.state_dir(CRI_NAMESPACE, pod_id), "shim.json")
    return json.loads(state.read_text())["pid"]


def test_exclusive_cpus_are_disjoint_refused_when_gone_and_freed_by_a_dead_shim(
        exclusive_ctd, tmp_path) -> None:
    """As many exclusive 1-CPU pods as the node's pool (less RESERVED) has CPUs free: each
    gets a CPU of its own, one more is refused with the counts, and the CPU of a pod whose
    shim was killed goes to the next pod. On a 1-CPU node: one pod, and its CPU back."""
    allocator = Allocator(reserved=RESERVED)  # the shim's view: online CPUs less RESERVED
    pool = allocator.pool
    assert len(pool) == min(len(ONLINE), MAX_EXCLUSIVE)
    held = {c for cpus in allocator.reservations().values() for c in cpus}  # by others
    free = sorted(pool - held)
    assert free, f"every CPU of the pool {format_cpu_list(pool)} is held by another pod"
    crictl = Crictl(exclusive_ctd.cri_endpoint, timeout="120s")
    pods = []
    try:
        for i in range(len(free)):
            ran = exclusive_pod(exclusive_ctd, tmp_path, crictl, f"x{i}")
            assert ran.returncode == 0, ran.stderr
            pods.append(ran.stdout.strip())
        cpusets = [pod_cpuset(p) for p in pods]
        assert sorted(int(c) for c in cpusets) == free  # one each, pairwise disjoint
        for p, cpu in zip(pods, cpusets):
            # 2 vCPUs (1 default + the 1 CPU requested), both on the pod's own CPU
            assert vcpu_affinities(p) == [{int(cpu)}] * 2
        refused = exclusive_pod(exclusive_ctd, tmp_path, crictl, "refused")
        assert refused.returncode != 0
        assert (f"asks for 1 exclusive CPU(s) but only 0 of the node's {len(pool)} "
                f"({format_cpu_list(pool)}) are free" in refused.stderr), refused.stderr
        assert all(p[:12] in refused.stderr for p in pods), refused.stderr
        if RESERVED:
            assert f"{RESERVED} reserved for the system" in refused.stderr, refused.stderr
        freed = cpusets[0]
        shim = shim_pid(pods[0])
        os.kill(shim, signal.SIGKILL)
        wait_for(f"shim {shim} to die", lambda: start_time(shim) is None, timeout=60)
        ran = exclusive_pod(exclusive_ctd, tmp_path, crictl, "after")
        assert ran.returncode == 0, ran.stderr
        pods.append(ran.stdout.strip())
        assert pod_cpuset(pods[-1]) == freed
    finally:
        for p in pods:
            crictl.run("stopp", p, check=False)
            crictl.run("rmp", p, check=False)
