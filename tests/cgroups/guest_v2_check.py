"""Run inside a podvm guest VM, whose kernel mounts a full cgroup v2 (cpu, cpuset, memory,
pids, io): exercises CgroupV2Manager on a real unified hierarchy the way a v2 host would,
and prints what the kernel reports as one `PODVM-CGTEST <json>` line for
test_v2_full_host.py to assert on. Stands alone: the guest has Python's stdlib only."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import cgroups  # noqa: E402
from cgroups import CgroupLimits, ControllerUnavailable, SandboxCgroup, SandboxLayout  # noqa

ROOT = "/sys/fs/cgroup"
FILES = ("cgroup.type", "cgroup.controllers", "cgroup.subtree_control", "cgroup.procs",
         "cgroup.threads", "cpu.max", "cpu.weight", "memory.max", "pids.max", "cpuset.cpus",
         "cpuset.mems", "cpuset.cpus.effective", "memory.current")


def snapshot(paths: list[str]) -> dict[str, dict[str, str]]:
    out = {}
    for path in paths:
        directory = os.path.join(ROOT, path.lstrip("/"))
        files = {}
        for name in FILES:
            try:
                with open(os.path.join(directory, name)) as f:
                    files[name] = f.read().strip()
            except OSError:
                pass
        out[path] = files
    return out


def unified_path(pid: int, tid: int) -> str:
    with open(f"/proc/{pid}/task/{tid}/cgroup") as f:
        return next(line.strip()[3:] for line in f if line.startswith("0::"))


def main() -> dict:
    obs: dict = {}
    manager = cgroups.detect()
    obs["manager"] = type(manager).__name__
    obs["controllers"] = sorted(manager.controllers)
    layout = SandboxLayout.from_cgroups_path(
        "kubepods-burstable-pod1234_abcd.slice:cri-containerd:sb1", "sb1")
    obs["layout"] = {"pod": layout.pod_cgroup, "sandbox": layout.sandbox}
    limits = CgroupLimits(cpu_quota_us=50_000, cpu_period_us=100_000, cpu_shares=512,
                          memory_limit_bytes=128 << 20, pids_limit=64, cpuset_cpus="1",
                          cpuset_mems="0")
    sandbox = SandboxCgroup.create(layout, limits)
    tree = layout.ancestors()[::-1] + [layout.sandbox, layout.vcpus, layout.vmm]
    obs["created"] = snapshot(tree)
    obs["read_back"] = dataclasses.asdict(sandbox.read_back().limits)

    helper = sandbox.spawn([sys.executable, "-B", "-S", os.path.join(HERE, "threads_helper.py"),
                            "3"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert helper.stdin and helper.stdout
    hello = json.loads(helper.stdout.readline())
    pid, (vcpu, *others) = hello["pid"], hello["threads"]
    obs["pid"], obs["vcpu"], obs["others"] = pid, vcpu, others
    obs["placed"] = sandbox.place_threads({"vcpu": [vcpu], "main": [pid], "worker": others})
    helper.stdin.write(f"spawn {vcpu}\n")
    helper.stdin.flush()
    born = int(helper.stdout.readline())
    obs["born_in"] = unified_path(pid, born)
    obs["caught"] = sandbox.place_new_threads(pid)
    obs["born"] = born
    obs["threads"] = {str(t): unified_path(pid, int(t)) for t in os.listdir(f"/proc/{pid}/task")}
    obs["sorted"] = snapshot([layout.sandbox, layout.vcpus, layout.vmm])
    with open(f"/proc/{pid}/status") as f:
        obs["rss_anon"] = next(int(line.split()[1]) * 1024 for line in f
                               if line.startswith("RssAnon:"))

    sandbox.apply(CgroupLimits(cpuset_cpus="1", vmm_cpuset_cpus="0"))
    obs["overhead_cpus"] = snapshot([layout.sandbox, layout.vcpus, layout.vmm])
    sandbox.apply(CgroupLimits())
    obs["unlimited"] = snapshot([layout.sandbox, layout.vcpus, layout.vmm])
    try:
        sandbox.apply(CgroupLimits(devices=cgroups.QEMU_DEVICES))
        obs["devices"] = "applied"
    except ControllerUnavailable as err:
        obs["devices"] = str(err)

    state = json.loads(json.dumps(sandbox.to_state()))
    obs["destroyed"] = sandbox.destroy()
    obs["helper_alive"] = helper.poll() is None
    obs["helper_after"] = unified_path(pid, pid)
    obs["left"] = [p for p in (layout.sandbox, layout.vcpus, layout.vmm)
                   if os.path.exists(os.path.join(ROOT, p.lstrip("/")))]
    obs["destroyed_again"] = SandboxCgroup.destroy_from_state(state)

    second = SandboxCgroup.create(SandboxLayout(layout.pod_cgroup, "sb2"))
    second.place_process(pid)
    state = json.loads(json.dumps(second.to_state()))
    del second
    obs["from_state"] = SandboxCgroup.destroy_from_state(state)
    obs["from_state_left"] = os.path.exists(os.path.join(ROOT, layout.pod_cgroup.lstrip("/"),
                                                         "podvm_sb2"))
    helper.kill()
    helper.wait()
    return obs


if __name__ == "__main__":
    try:
        print("PODVM-CGTEST " + json.dumps(main()), flush=True)
    except BaseException:
        print("PODVM-CGTEST-ERROR " + json.dumps(traceback.format_exc()), flush=True)
