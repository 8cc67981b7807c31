"""Every host thread of a VM in the sandbox cgroup, sorted by role, on cgroup v1 (the
host's hierarchies) and v2 (a threaded subtree): read back from /proc, not from what the
package believes it wrote."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from cgroups import NotInSandbox, SandboxCgroup
from testbed.containerd import REPO_ROOT
from tests.cgroups.conftest import cgroups_of, expected_for, proc_cgroups, threads_of, where


def sandbox_dirs(manager, layout) -> list[str]:
    """Every directory of the sandbox in every hierarchy the manager uses."""
    if manager.version == 2:
        return [os.path.join(manager.hierarchy.mountpoint, p.lstrip("/"))
                for p in (layout.sandbox, layout.vcpus, layout.vmm)]
    return [os.path.join(h.mountpoint, p.lstrip("/")) for h in manager.hierarchies
            for p in (layout.sandbox, layout.vcpus, layout.vmm)]


def nearest_taking_processes(manager, layout) -> str:
    """v1: the pod cgroup. v2: the nearest ancestor with no controller enabled for its
    children (the no-internal-process rule), at worst the root."""
    if manager.version == 1:
        return layout.pod_cgroup
    for path in layout.ancestors():
        directory = os.path.join(manager.hierarchy.mountpoint, path.lstrip("/"))
        with open(os.path.join(directory, "cgroup.subtree_control")) as f:
            if path == "/" or not f.read().strip():
                return path
    raise AssertionError("unreachable: the root takes processes")


def test_every_qemu_thread_lands_where_its_role_says(manager, layout, start_qemu):
    sandbox = SandboxCgroup.create(layout, manager=manager)
    qemu = start_qemu(sandbox)
    roles = qemu.roles()
    assert len(roles["vcpu"]) == 2 and len(roles["iothread"]) == 1
    placed = sandbox.place_threads(roles)
    assert {r: sorted(t) for r, t in placed.items()} == \
        {r: sorted(t) for r, t in roles.items() if t}

    vcpus = set(roles["vcpu"])
    for tid in threads_of(qemu.pid):
        child = "vcpus" if tid in vcpus else "vmm"
        assert where(manager, qemu.pid, tid) == expected_for(manager, layout, child), tid
        for path in where(manager, qemu.pid, tid).values():
            assert path.startswith(layout.pod_cgroup + "/")

    report = sandbox.read_back()
    by_tid = {t.tid: t for t in report.threads}
    assert set(by_tid) == set(threads_of(qemu.pid))
    for tid, thread in by_tid.items():
        assert thread.location == ("vcpus" if tid in vcpus else "vmm")
        assert thread.pid == qemu.pid
    assert {by_tid[t].name for t in vcpus} == {"CPU 0/TCG", "CPU 1/TCG"}
    assert by_tid[roles["iothread"][0]].role == "iothread"


def test_placing_vcpu_threads_moves_only_those_threads(manager, layout, start_qemu):
    """Kata on v2 writes a vCPU thread id to cgroup.procs and moves the whole process."""
    sandbox = SandboxCgroup.create(layout, manager=manager)
    qemu = start_qemu(sandbox)
    vcpus = qemu.vcpus()
    sandbox.place_threads({"vcpu": vcpus})
    for tid in threads_of(qemu.pid):
        expected = expected_for(manager, layout, "vcpus" if tid in vcpus else None)
        assert where(manager, qemu.pid, tid) == expected, tid


def _seen(proc_self_cgroup: str, expected: dict[str, str]) -> dict[str, str]:
    """/proc/PID/cgroup's paths, by controller (or `unified`), of those `expected` names."""
    return {k: v for k, v in cgroups_of(proc_self_cgroup).items() if k in expected}


def test_a_process_is_inside_before_it_execs(manager, layout, processes):
    sandbox = SandboxCgroup.create(layout, manager=manager)
    proc = processes.add(sandbox.spawn(["cat", "/proc/self/cgroup"], stdout=subprocess.PIPE,
                                       text=True))
    out, _ = proc.communicate(timeout=10)
    expected = expected_for(manager, layout, None)
    assert _seen(out, expected) == expected


PLACED_PARENT = """
import json, os, subprocess, sys
from cgroups.sandbox import SandboxCgroup
enter = SandboxCgroup.from_state(json.loads(sys.argv[1])).preexec()
child = subprocess.run(["cat", "/proc/self/cgroup"], preexec_fn=enter, capture_output=True,
                       text=True, check=True).stdout
print(json.dumps({"enter": enter is not None, "child": child}))
"""
"""A process in the sandbox cgroup (a shim placed there) forks a child with preexec()."""


def test_a_parent_inside_forks_its_child_inside_with_no_move(manager, layout, processes):
    """A parent in the sandbox cgroup gets no preexec (the move would wait out an RCU
    grace period to go nowhere, and a preexec_fn makes subprocess fork where it would
    vfork), and its child is inside all the same; the test's own process, outside,
    still gets the one that moves the child."""
    sandbox = SandboxCgroup.create(layout, manager=manager)
    assert sandbox.preexec().__name__ == "enter_sandbox_cgroup"
    parent = processes.add(sandbox.spawn(
        [sys.executable, "-c", PLACED_PARENT, json.dumps(sandbox.to_state())], cwd=REPO_ROOT,
        stdout=subprocess.PIPE, text=True))
    out, _ = parent.communicate(timeout=30)
    assert parent.returncode == 0
    got = json.loads(out)
    assert got["enter"] is False
    expected = expected_for(manager, layout, None)
    assert _seen(got["child"], expected) == expected


def test_threads_made_later_are_caught(manager, layout, start_helper):
    """A thread starts in its creator's cgroup: one made by a vCPU thread lands in vcpus/
    and must be moved; vcpu threads made by the main loop (hot-plug) land in vmm/."""
    sandbox = SandboxCgroup.create(layout, manager=manager)
    helper = start_helper(sandbox, threads=3)
    vcpu, *others = helper.workers
    sandbox.place_threads({"vcpu": [vcpu]})
    moved = sandbox.place_new_threads(helper.pid)
    assert sorted(moved["other"]) == sorted(others)
    assert moved["main"] == [helper.pid]

    born_in_vcpus = helper.spawn_from(vcpu)
    assert where(manager, helper.pid, born_in_vcpus) == expected_for(manager, layout, "vcpus")
    new_vcpu = helper.spawn_from(others[0])
    assert where(manager, helper.pid, new_vcpu) == expected_for(manager, layout, "vmm")

    moved = sandbox.place_new_threads(helper.pid, vcpus=[new_vcpu])
    assert moved == {"other": [born_in_vcpus], "vcpu": [new_vcpu]}
    for tid in threads_of(helper.pid):
        child = "vcpus" if tid in (vcpu, new_vcpu) else "vmm"
        assert where(manager, helper.pid, tid) == expected_for(manager, layout, child), tid
    assert sandbox.place_new_threads(helper.pid) == {}


def test_hotplugged_vcpu_thread_is_moved_to_vcpus(manager, layout, start_qemu):
    sandbox = SandboxCgroup.create(layout, manager=manager)
    qemu = start_qemu(sandbox)
    sandbox.place_threads(qemu.roles())
    new = qemu.hotplug_cpu()
    assert where(manager, qemu.pid, new) == expected_for(manager, layout, "vmm")
    assert sandbox.place_new_threads(qemu.pid, vcpus=qemu.vcpus()) == {"vcpu": [new]}
    assert where(manager, qemu.pid, new) == expected_for(manager, layout, "vcpus")


def test_sorting_threads_of_a_process_outside_the_sandbox_is_refused(manager, layout,
                                                                      start_helper):
    sandbox = SandboxCgroup.create(layout, manager=manager)
    helper = start_helper(None)
    before = {t: proc_cgroups(helper.pid, t) for t in threads_of(helper.pid)}
    with pytest.raises(NotInSandbox, match=f"place_process\\({helper.pid}\\)"):
        sandbox.place_threads({"vcpu": helper.workers[:1]})
    assert {t: proc_cgroups(helper.pid, t) for t in threads_of(helper.pid)} == before

    sandbox.place_process(helper.pid)
    for tid in threads_of(helper.pid):
        assert where(manager, helper.pid, tid) == expected_for(manager, layout, None)


def test_teardown_moves_leftovers_out_kills_nothing_and_is_idempotent(manager, layout,
                                                                       start_helper):
    sandbox = SandboxCgroup.create(layout, manager=manager)
    helper = start_helper(sandbox)
    sandbox.place_threads({"vcpu": helper.workers[:1], "other": helper.workers[1:]})
    assert sandbox.destroy() is True
    assert helper.proc.poll() is None
    for tid in threads_of(helper.pid):
        assert set(where(manager, helper.pid, tid).values()) == \
            {nearest_taking_processes(manager, layout)}
    for directory in sandbox_dirs(manager, layout):
        assert not os.path.exists(directory)
    assert sandbox.destroy() is False


def test_destroy_from_persisted_state_in_another_process(manager, layout, start_qemu):
    """After a shim crash, `delete` has only what to_state() returned."""
    sandbox = SandboxCgroup.create(layout, manager=manager)
    qemu = start_qemu(sandbox)
    sandbox.place_threads(qemu.roles())
    state = json.dumps(sandbox.to_state())
    del sandbox
    qemu.proc.kill()
    qemu.proc.wait()
    code = ("import json, sys, cgroups; "
            "print(cgroups.SandboxCgroup.destroy_from_state(json.load(sys.stdin)))")
    run = lambda: subprocess.run([sys.executable, "-c", code], input=state, text=True,  # noqa
                                 capture_output=True, cwd=os.getcwd(), timeout=30)
    first = run()
    assert first.returncode == 0, first.stderr
    assert first.stdout.strip() == "True"
    for directory in sandbox_dirs(manager, layout):
        assert not os.path.exists(directory)
    assert run().stdout.strip() == "False"


def test_leftovers_go_where_the_caller_says(manager, layout, start_helper, test_root):
    sandbox = SandboxCgroup.create(layout, manager=manager)
    helper = start_helper(sandbox)
    sandbox.place_new_threads(helper.pid)
    target = test_root
    if manager.version == 2:  # a leaf: v2 domains with controllers on take no process
        target = f"{test_root}/elsewhere"
        os.mkdir(os.path.join(manager.hierarchy.mountpoint, target.lstrip("/")))
    assert sandbox.destroy(move_to=target) is True
    for tid in threads_of(helper.pid):
        assert set(where(manager, helper.pid, tid).values()) == {target}


def test_a_refused_thread_moves_no_thread(manager, layout, start_helper):
    """One thread of a process outside the sandbox in the request: nothing is moved."""
    sandbox = SandboxCgroup.create(layout, manager=manager)
    inside = start_helper(sandbox)
    outside = start_helper(None)
    with pytest.raises(NotInSandbox):
        sandbox.place_threads({"vcpu": inside.workers[:1], "other": outside.workers[:1]})
    for tid in threads_of(inside.pid):
        assert where(manager, inside.pid, tid) == expected_for(manager, layout, None)


def test_a_thread_sorted_in_one_v1_hierarchy_only_is_put_right(v1_manager, layout,
                                                               start_helper):
    sandbox = SandboxCgroup.create(layout, manager=v1_manager)
    helper = start_helper(sandbox)
    sandbox.place_new_threads(helper.pid)
    stray = helper.workers[0]
    (cpu,) = [h for h in v1_manager.hierarchies if "cpu" in h.controllers]
    with open(os.path.join(cpu.mountpoint, layout.vcpus.lstrip("/"), "tasks"), "w") as f:
        f.write(str(stray))
    assert {t.tid: t.location for t in sandbox.read_back().threads}[stray] == "mixed"
    assert sandbox.place_new_threads(helper.pid) == {"other": [stray]}
    assert where(v1_manager, helper.pid, stray) == expected_for(v1_manager, layout, "vmm")
