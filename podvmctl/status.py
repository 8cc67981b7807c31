"""`podvmctl status`: one sandbox as the kernel sees it now, next to its plan. Read from
the sandbox's persisted state and /proc and the cgroup files, never from the shim (which
may be gone): every QEMU thread with its role and cgroups, the limits read back, the
VM's size, and Kubernetes' view of the pod beside the host's with differences flagged."""
from __future__ import annotations

import glob
import os
from dataclasses import asdict

import cgroups

from shim.host import diskreserve, paths, shimstate
from shim.host.cleanup import processes_of
from shim.vm.qemu.jail import confinement
from shim.host.podstate import STATE_FILE, PodState, state_path
from shim.host.processes import start_time

MIB = 1 << 20


class StatusError(Exception):
    pass


def find(sandbox_id: str, namespace: str = "") -> str:
    """The state directory of `sandbox_id` (in `namespace`, or the only one that has it)."""
    if namespace:
        found = [paths.state_dir(namespace, sandbox_id)]
    else:
        found = sorted(os.path.dirname(p) for p in glob.glob(
            os.path.join(paths.STATE_ROOT, "*", glob.escape(sandbox_id), STATE_FILE)))
    found = [d for d in found if os.path.isfile(os.path.join(d, STATE_FILE))]
    if not found:
        where = f"namespace {namespace}" if namespace else f"any namespace under " \
                                                          f"{paths.STATE_ROOT}"
        raise StatusError(f"no sandbox {sandbox_id!r} in {where}")
    if len(found) > 1:
        spaces = ", ".join(os.path.basename(os.path.dirname(d)) for d in found)
        raise StatusError(f"sandbox {sandbox_id!r} exists in several namespaces ({spaces}): "
                          f"pass --namespace")
    return found[0]


def thread_role(pid: int, tid: int, name: str, shim_pid: int) -> str:
    """From QEMU's thread names (it runs with debug-threads=on), and the pod's virtiofsd
    (shim/vm/virtiofsd.py), whose threads all bear its name."""
    if pid == shim_pid:
        return "shim"
    if name.startswith("virtiofsd"):
        return "files"
    if name.startswith("CPU "):
        return "vcpu"
    if name.startswith("IO "):
        return "iothread"
    if name.startswith("vhost-"):
        # vhost-net's worker: a thread of QEMU's since Linux 6.4 (a kernel thread in
        # QEMU's cgroups before): it moves the NIC's packets, charged to the pod.
        return "net"
    return "main" if tid == pid else "other"


def collect(state_dir: str) -> dict:
    state = PodState.load(state_path(state_dir))
    namespace = os.path.basename(os.path.dirname(state_dir))
    shim_pid = (shimstate.read(namespace, os.path.basename(state_dir)) or {}).get("pid")
    shim_pid = shim_pid if isinstance(shim_pid, int) else 0
    report: dict = {"sandbox_id": state.sandbox_id, "namespace": namespace,
                    "qemu_pid": state.qemu_pid, "shim_pid": shim_pid,
                    "restored_from": state.restored_from,
                    "qmp_socket": state.qmp_socket, "plan": asdict(state.plan),
                    "vm": asdict(state.vm) if state.vm is not None else {},
                    "network": {"netns": state.netns, "taps": list(state.taps),
                                **(asdict(state.network) if state.network else {})}}
    outside: list[str] = []
    sandbox = cgroups.SandboxCgroup(cgroups.manager_from_state(dict(state.cgroup.manager)),
                                    state.cgroup.layout)
    if state.qemu_pid:
        started = start_time(state.qemu_pid)  # another than recorded: a later process's pid
        gone = started is None or state.qemu_start_time not in (None, started)
        if not gone:
            try:
                sandbox.adopt_process(state.qemu_pid)
            except cgroups.ProcessGone:
                gone = True
            except cgroups.NotInSandbox as exc:
                outside.append(str(exc))
        if gone:
            outside.append(f"QEMU {state.qemu_pid} has exited")
        else:
            report["confinement"] = confinement(state.qemu_pid)
            disk = diskreserve.of_pod(state, None)
            if disk is not None:
                report["disk"] = {"size_bytes": disk.st_size,
                                  "held_bytes": disk.st_blocks * 512}
    report["file_daemon"] = [dict(pid=pid, **confinement(pid)) for pid in
                             processes_of("virtiofsd", state_dir + "/")]
    back = sandbox.read_back()
    report["cgroup"] = {
        "version": back.version, "path": back.sandbox,
        "controllers": sorted(back.controllers),
        "limits": asdict(back.limits),
        "threads": [dict(tid=t.tid, pid=t.pid, name=t.name,
                         role=thread_role(t.pid, t.tid, t.name, shim_pid),
                         location=t.location, cgroups=dict(t.cgroups))
                    for t in back.threads],
        "pod_cgroup": state.cgroup.layout.pod_cgroup,
    }
    report["differences"] = outside + differences(report)
    return report


def differences(report: dict) -> list[str]:
    """Where Kubernetes' view (the pod's limits plus the RuntimeClass overhead the plan
    expects), the VM and the host cgroup do not agree."""
    plan, out = report.get("plan") or {}, []
    limits = (report.get("cgroup") or {}).get("limits") or {}
    if plan and limits:
        want_mem = plan.get("cgroup_memory_limit", -1)
        have_mem = limits.get("memory_limit_bytes")
        if want_mem > 0 and have_mem != want_mem:
            out.append(f"memory: the plan says {want_mem // MIB} MiB, the sandbox cgroup "
                       f"has {_mib(have_mem)}")
        want_quota = plan.get("cgroup_cpu_quota", -1)
        have_quota = limits.get("cpu_quota_us")
        if want_quota > 0 and have_quota != want_quota:
            out.append(f"cpu: the plan says quota {want_quota} us, the sandbox cgroup has "
                       f"{have_quota or 'none'}")
    disk = report.get("disk") or {}
    if plan.get("disk_mib") and disk and disk["size_bytes"] != plan["disk_mib"] * MIB:
        out.append(f"disk: the plan says a {plan['disk_mib']} MiB scratch disk, QEMU's is "
                   f"{disk['size_bytes'] // MIB} MiB")
    vm = report.get("vm") or {}
    if plan and vm.get("online_cpus") and vm["online_cpus"] != plan.get("vcpus"):
        out.append(f"vCPUs: the plan says {plan.get('vcpus')}, the guest has "
                   f"{vm['online_cpus']} online")
    if plan and vm.get("qemu_memory_mib") and vm["qemu_memory_mib"] != plan.get("memory_mib"):
        out.append(f"memory: the plan says {plan.get('memory_mib')} MiB, QEMU gave the VM "
                   f"{vm['qemu_memory_mib']} MiB")
    k8s = kubernetes_view(plan)
    if k8s and limits:
        if k8s["memory_mib"] and limits.get("memory_limit_bytes") is not None and \
                limits["memory_limit_bytes"] // MIB != k8s["memory_mib"]:
            out.append(f"memory: Kubernetes counts {k8s['memory_mib']} MiB for the pod "
                       f"(limits + overhead), the host gives "
                       f"{limits['memory_limit_bytes'] // MIB} MiB")
        quota, period = limits.get("cpu_quota_us"), limits.get("cpu_period_us")
        if k8s["cpus"] and quota and period and abs(quota / period - k8s["cpus"]) > 0.01:
            out.append(f"cpu: Kubernetes counts {k8s['cpus']:g} CPUs for the pod (limits + "
                       f"overhead), the host's quota is {quota / period:g}")
    for t in (report.get("cgroup") or {}).get("threads", []):
        expected = {"vcpu": ("vcpus",), "shim": ("sandbox", "vmm", "outside")}.get(
            t["role"], ("vmm",))
        if t["location"] not in expected:
            out.append(f"thread {t['tid']} ({t['name']}, {t['role']}) is in "
                       f"{t['location']}, not {' or '.join(expected)}")
    return out


def _relative(groups: dict[str, str], sandbox: str) -> str:
    """`cpu,cpuacct: vmm; memory: .` — controllers by path, relative to the sandbox."""
    by_path: dict[str, list[str]] = {}
    for controller, path in sorted(groups.items()):
        if path == sandbox or path.startswith(sandbox + "/"):
            path = path[len(sandbox) + 1:] or "."
        by_path.setdefault(path, []).append(controller)
    return "; ".join(f"{','.join(cs)}: {p}" for p, cs in sorted(by_path.items()))


def kubernetes_view(plan: dict) -> dict:
    """The pod as Kubernetes counts it: the containers' limits plus the RuntimeClass
    overhead the plan expects; 0 where the pod has no limit."""
    if not plan:
        return {}
    memory = plan.get("workload_memory_mib", 0)
    cpus = plan.get("workload_cpus", 0.0)
    return {"memory_mib": memory + plan["overhead_memory_mib"] if memory else 0,
            "cpus": round(cpus + plan["overhead_cpu_millis"] / 1000, 3)
            if plan["cgroup_cpu_quota"] > 0 else 0.0}


def _kernel_keeps(vm: dict) -> str:
    """What the guest kernel keeps of the VM's memory for itself (its image, memmap)."""
    if not vm.get("qemu_memory_mib") or not vm.get("memory_total_mib"):
        return ""
    return (f" ({vm['qemu_memory_mib'] - vm['memory_total_mib']} MiB less: the guest "
            f"kernel's own)")


def _mib(value: int | None) -> str:
    return "no limit" if value is None else f"{value // MIB} MiB"


def _network_lines(net: dict) -> list[str]:
    if not net.get("netns"):
        return ["network: none (a network namespace of its own, no interface)"]
    taps = iter(net.get("taps") or [])
    lines = [f"network: namespace {net['netns']}"]
    for itf in net.get("interfaces") or []:
        addresses = ", ".join(f"{a['address']}/{a['prefix_len']}" for a in itf["addresses"])
        lines.append(f"  {itf['name']} {itf['mac']} MTU {itf['mtu']} "
                     f"{addresses or 'no address'}, bridged by {next(taps, '?')}")
    for r in net.get("routes") or []:
        if r.get("protocol") != "kernel":
            lines.append(f"  route {r['destination']}" + (f" via {r['gateway']}" if
                         r.get("gateway") else "") + f" dev {r['device']}")
    return lines


def _confinement_lines(qemu: dict | None, file_daemon: list[dict]) -> list[str]:
    """QEMU's and the file daemon's confinement as /proc shows it
    (docs/threat-model.md)."""
    return [f"{who} confinement: {_confined(c)}" for who, c in
            [("QEMU", qemu), *((f"file daemon {d['pid']}", d) for d in file_daemon)]
            if c and "uid" in c]


def _confined(c: dict) -> str:
    return (f"uid {c['uid']} gid {c['gid']}, seccomp {c['seccomp']}"
            f"{' (filter)' if c['seccomp'] == 2 else ' (none)'}, no_new_privs "
            f"{c['no_new_privs']}, capabilities {','.join(c['capabilities']) or 'none'}, "
            f"own namespaces {','.join(c['own_namespaces']) or 'none'}")


def render(report: dict) -> str:
    plan, vm = report.get("plan") or {}, report.get("vm") or {}
    lines = [f"sandbox {report['sandbox_id']} (namespace {report['namespace']}): "
             f"QEMU pid {report['qemu_pid'] or '-'}, shim pid {report['shim_pid'] or '-'}"]
    if plan:
        quota = plan["cgroup_cpu_quota"]
        capped = plan.get("uncapped_vcpus", 0) > plan["vcpus"]
        lines += [
            f"plan: {plan['vcpus']} vCPUs (" + (
                f"capped from {plan['uncapped_vcpus']}: at most " if capped else "up to ") +
            f"{plan['max_vcpus']}), {plan['memory_mib']} MiB "
            f"(up to {plan['max_memory_mib']} MiB); sandbox cgroup: cpu "
            f"{'quota %d/%d us' % (quota, plan['cgroup_cpu_period']) if quota > 0 else 'no quota'}"
            f", shares {plan['cgroup_cpu_shares']}, memory "
            f"{_mib(plan['cgroup_memory_limit'] if plan['cgroup_memory_limit'] > 0 else None)}"
            f", cpuset {plan['cpuset'] or 'all'}",
            f"Kubernetes: the RuntimeClass overhead for this plan is memory "
            f"{plan['overhead_memory_mib']}Mi, cpu {plan['overhead_cpu_millis']}m"]
        if plan.get("disk_mib"):
            disk = report.get("disk")
            lines.append(f"scratch disk: {plan['disk_mib']} MiB" + (
                f", holding {disk['held_bytes'] / MIB:.1f} MiB of the host's disk now"
                if disk else ""))
        lines += [f"  why: {line}" for line in plan.get("explanation", [])]
    if vm:
        lines.append(f"VM: QEMU gave it {vm.get('qemu_vcpus', '?')} vCPUs and "
                     f"{vm.get('qemu_memory_mib', '?')} MiB; the guest has "
                     f"{vm.get('online_cpus')} vCPUs online, MemTotal "
                     f"{vm.get('memory_total_mib')} MiB" + _kernel_keeps(vm))
        lines.append(f"  restored from template {report['restored_from']}"
                     if report.get("restored_from") else "  booted (no template)")
    lines += _confinement_lines(report.get("confinement"), report.get("file_daemon") or [])
    lines += _network_lines(report.get("network") or {})
    k8s = kubernetes_view(plan)
    if k8s:
        lines.append("Kubernetes counts the pod as: cpu " + (
            f"{k8s['cpus']:g}" if k8s["cpus"] else "no limit") + ", memory " + (
            f"{k8s['memory_mib']} MiB" if k8s["memory_mib"] else "no limit") +
            " (limits + RuntimeClass overhead)")
    cg = report.get("cgroup")
    if cg:
        lim = cg["limits"]
        lines.append(f"cgroup v{cg['version']} {cg['path']} (pod cgroup {cg['pod_cgroup']}; "
                     f"{', '.join(cg['controllers'])})")
        lines.append("  read back: " + ", ".join(
            f"{k} {v}" for k, v in lim.items() if v is not None and k != "devices"))
        lines.append(f"  {'TID':>7}  {'NAME':<18} {'ROLE':<9} {'WHERE':<8} CGROUPS "
                     f"(. = the sandbox cgroup)")
        for t in cg["threads"]:
            lines.append(f"  {t['tid']:>7}  {t['name'][:18]:<18} {t['role']:<9} "
                         f"{t['location']:<8} {_relative(t['cgroups'], cg['path'])}")
    diffs = report.get("differences") or []
    lines.append("differences: " + ("none" if not diffs else ""))
    lines += [f"  ! {d}" for d in diffs]
    return "\n".join(lines)
