"""CgroupV2Manager on a full cgroup v2 host (cpu, cpuset, memory, pids, io), which this
hybrid machine is not: our guest VM's kernel mounts one, so the same package runs there
(guest_v2_check.py) and reports what the kernel says."""
from __future__ import annotations

import json
import pathlib

import pytest

from testbed.vmconfig import ROOT
from tests.guestprobe import run_probe

HERE = pathlib.Path(__file__).parent
SCRIPT = """export PATH=/usr/sbin:/usr/bin:/sbin:/bin
mount -t cgroup2 cgroup2 /sys/fs/cgroup
echo "+cpu +cpuset +memory +pids +io" > /sys/fs/cgroup/cgroup.subtree_control
/usr/bin/python3 -B -S /tmp/podvm-probe/guest_v2_check.py
"""


def probe_files() -> dict[str, bytes]:
    """The check, its helper, this package and the plain modules of the core package it
    imports (CPU lists)."""
    files = {name: (HERE / name).read_bytes()
             for name in ("guest_v2_check.py", "threads_helper.py")}
    for package in ("cgroups", "podvm_core"):
        for path in sorted((ROOT / package).glob("*.py")):
            files[f"{package}/{path.name}"] = path.read_bytes()
    return files


@pytest.fixture(scope="module")
def guest_report(tmp_path_factory) -> dict:
    text = run_probe(tmp_path_factory.mktemp("cgv2"), SCRIPT, root=True,
                     files=probe_files(), memory_mib=512, vcpus=2)
    for line in text.splitlines():
        if line.startswith("PODVM-CGTEST-ERROR "):
            pytest.fail("the check failed in the guest:\n" + json.loads(line.split(" ", 1)[1]))
        if line.startswith("PODVM-CGTEST "):
            return json.loads(line.split(" ", 1)[1])
    pytest.fail(f"no report from the guest; console:\n{text[-3000:]}")


def test_a_full_v2_host_gets_the_v2_manager_with_every_controller(guest_report):
    assert guest_report["manager"] == "CgroupV2Manager"
    assert guest_report["controllers"] == ["cpu", "cpuset", "io", "memory", "pids"]


def test_every_level_hands_the_controllers_down_and_children_are_threaded(guest_report):
    created, layout = guest_report["created"], guest_report["layout"]
    assert layout["pod"] == ("/kubepods.slice/kubepods-burstable.slice/"
                             "kubepods-burstable-pod1234_abcd.slice")
    for path in list(created)[:-3]:  # "/" down to the pod cgroup
        assert set(created[path]["cgroup.subtree_control"].split()) >= \
            {"cpu", "cpuset", "memory", "pids", "io"}, path
    sandbox = created[layout["sandbox"]]
    assert sandbox["cgroup.type"] == "domain threaded"
    assert set(sandbox["cgroup.controllers"].split()) == {"cpu", "cpuset", "memory", "pids",
                                                          "io"}
    assert set(sandbox["cgroup.subtree_control"].split()) == {"cpu", "cpuset"}
    for child in ("vcpus", "vmm"):
        files = created[f"{layout['sandbox']}/{child}"]
        assert files["cgroup.type"] == "threaded"
        assert set(files["cgroup.controllers"].split()) == {"cpu", "cpuset"}
        assert files["cpuset.cpus"] == files["cpuset.cpus.effective"] == "1"


def test_limits_are_in_the_files_and_read_back(guest_report):
    sandbox = guest_report["created"][guest_report["layout"]["sandbox"]]
    assert sandbox["cpu.max"] == "50000 100000"
    assert sandbox["cpu.weight"] == "20"
    assert sandbox["memory.max"] == str(128 << 20)
    assert sandbox["pids.max"] == "64"
    assert (sandbox["cpuset.cpus"], sandbox["cpuset.mems"]) == ("1", "0")
    read_back = guest_report["read_back"]
    assert (read_back["cpu_quota_us"], read_back["cpu_period_us"], read_back["cpu_weight"],
            read_back["memory_limit_bytes"], read_back["pids_limit"],
            read_back["cpuset_cpus"]) == (50_000, 100_000, 20, 128 << 20, 64, "1")


def test_vmm_gets_its_own_cpus_when_an_overhead_set_is_given(guest_report):
    cpus, sandbox = guest_report["overhead_cpus"], guest_report["layout"]["sandbox"]
    assert (cpus[f"{sandbox}/vcpus"]["cpuset.cpus"], cpus[f"{sandbox}/vmm"]["cpuset.cpus"],
            cpus[sandbox]["cpuset.cpus"]) == ("1", "0", "0-1")


def test_none_resets_every_limit(guest_report):
    """A populated cgroup's cpuset cannot go back to "inherit" (the kernel answers ENOSPC):
    None gives it the pod's CPUs (the guest has two)."""
    unlimited, sandbox = guest_report["unlimited"], guest_report["layout"]["sandbox"]
    assert (unlimited[sandbox]["cpu.max"], unlimited[sandbox]["cpu.weight"],
            unlimited[sandbox]["memory.max"], unlimited[sandbox]["pids.max"]) == \
        ("max 100000", "100", "max", "max")
    for path in (sandbox, f"{sandbox}/vcpus", f"{sandbox}/vmm"):
        assert unlimited[path]["cpuset.cpus"] == "0-1"
    assert "devices" in guest_report["devices"]


def test_threads_are_sorted_and_the_process_stays_in_the_domain(guest_report):
    r, sandbox = guest_report, guest_report["layout"]["sandbox"]
    assert r["born_in"] == f"{sandbox}/vcpus"  # made by the vCPU thread
    assert r["caught"] == {"other": [r["born"]]}
    for tid, path in r["threads"].items():
        assert path == f"{sandbox}/{'vcpus' if int(tid) == r['vcpu'] else 'vmm'}", tid
    files = r["sorted"]
    assert files[sandbox]["cgroup.procs"] == str(r["pid"])
    assert files[sandbox]["cgroup.threads"] == ""
    assert files[f"{sandbox}/vcpus"]["cgroup.threads"] == str(r["vcpu"])
    assert int(files[sandbox]["memory.current"]) >= r["rss_anon"] > 0


def test_teardown_moves_the_process_up_to_where_processes_may_live(guest_report):
    """Every ancestor has controllers enabled for its children, so only the root takes
    processes on a full v2 host."""
    r = guest_report
    assert r["destroyed"] is True
    assert r["helper_alive"] is True
    assert r["helper_after"] == "/"
    assert r["left"] == []
    assert r["destroyed_again"] is False
    assert r["from_state"] is True
    assert r["from_state_left"] is False
