"""The guest's own resources: online CPUs and memory, hot-plugged ones brought online,
and each container's cgroup v2 statistics."""
from __future__ import annotations

import os

from google.protobuf.any_pb2 import Any

from podvm_core.cpulist import parse_cpu_list


CGROUP = "/sys/fs/cgroup/podvm"


def online() -> tuple[int, int]:
    cpus = _online_cpus()
    with open("/proc/meminfo") as f:
        total = int(f.readline().split()[1]) * 1024
    return cpus, total


def _online_cpus() -> int:
    try:
        with open("/sys/devices/system/cpu/online") as f:
            return len(parse_cpu_list(f.read(), "online CPUs"))
    except OSError:
        return os.cpu_count() or 1


def online_hotplugged(cpus: int = 0) -> None:
    """Bring up memory blocks that arrived offline, and CPUs: all of them, or exactly the
    first `cpus` (the host shrinks a VM by taking vCPUs offline here: unplugging them
    crashes QEMU 7.2 under TCG on its next hot-plug)."""
    import glob  # only now: the agent's start does without glob and fnmatch

    for path in glob.glob("/sys/devices/system/memory/memory[0-9]*/online"):
        _set(path, "1")
    for path in glob.glob("/sys/devices/system/cpu/cpu[0-9]*/online"):  # cpu0 has none
        index = int(path.split("/")[-2][3:])
        _set(path, "1" if not cpus or index < cpus else "0")


def _set(path: str, value: str) -> None:
    try:
        with open(path) as f:
            if f.read().strip() == value:
                return
        with open(path, "w") as f:
            f.write(value)
    except OSError:
        pass


def _kv(path: str) -> dict[str, int]:
    values: dict[str, int] = {}
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(" ")
                if value.strip().isdigit():
                    values[key] = int(value)
    except OSError:
        pass
    return values


def _single(path: str) -> int:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return 0
    return int(text) if text.isdigit() else 0


def metrics(container_id: str):
    """The container's cgroup v2 statistics as containerd's Metrics, in an Any."""
    # Loaded at the first stats call, not at boot: every import before the agent serves
    # costs boot time under TCG.
    from podvm_core.pb.containerd.cgroups.v2 import metrics_pb2 as m

    base = os.path.join(CGROUP, container_id)
    cpu = _kv(os.path.join(base, "cpu.stat"))
    mem = _kv(os.path.join(base, "memory.stat"))
    events = _kv(os.path.join(base, "memory.events"))
    stat = m.MemoryStat(usage=_single(os.path.join(base, "memory.current")),
                        usage_limit=_single(os.path.join(base, "memory.max")),
                        swap_usage=_single(os.path.join(base, "memory.swap.current")),
                        max_usage=_single(os.path.join(base, "memory.peak")))
    for field in m.MemoryStat.DESCRIPTOR.fields:
        if field.name in mem:
            setattr(stat, field.name, mem[field.name])
    metrics = m.Metrics(
        pids=m.PidsStat(current=_single(os.path.join(base, "pids.current")),
                        limit=_single(os.path.join(base, "pids.max"))),
        cpu=m.CPUStat(**{k: cpu.get(k, 0) for k in (
            "usage_usec", "user_usec", "system_usec", "nr_periods", "nr_throttled",
            "throttled_usec")}),
        memory=stat,
        memory_events=m.MemoryEvents(**{k: events.get(k, 0) for k in (
            "low", "high", "max", "oom", "oom_kill")}))
    # containerd names these types by their bare full name
    return Any(type_url=m.Metrics.DESCRIPTOR.full_name, value=metrics.SerializeToString())


def oom_kills(container_id: str) -> int:
    return _kv(os.path.join(CGROUP, container_id, "memory.events")).get("oom_kill", 0)
