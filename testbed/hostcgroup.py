"""The harness tests and benchmarks share: a task shim's sandbox as the host sees it, its
state file and what its sandbox cgroup is charged against what its QEMU used."""
from __future__ import annotations

import json
import os
import pathlib

from .taskshim import NS


def sandbox_state() -> dict:
    return json.loads(pathlib.Path(f"/run/podvm/{NS}/sb/sandbox.json").read_text())


def charged(qemu_pid: int, sandbox_cgroup: str) -> dict[str, float]:
    """QEMU's own figures first, the cgroup's after: the cgroup's only grow meanwhile."""
    ticks = os.sysconf("SC_CLK_TCK")
    fields = pathlib.Path(f"/proc/{qemu_pid}/stat").read_text().rsplit(")", 1)[1].split()
    qemu_cpu = (int(fields[11]) + int(fields[12])) / ticks  # utime + stime, all threads
    status = dict(line.split(":", 1) for line in
                  pathlib.Path(f"/proc/{qemu_pid}/status").read_text().splitlines())
    rss = int(status["VmRSS"].split()[0]) / 1024
    anon = (int(status["RssAnon"].split()[0]) + int(status["RssShmem"].split()[0])) / 1024
    base = "/sys/fs/cgroup"
    usage = int(pathlib.Path(f"{base}/cpuacct{sandbox_cgroup}/cpuacct.usage").read_text())
    memory = int(pathlib.Path(f"{base}/memory{sandbox_cgroup}/memory.usage_in_bytes")
                 .read_text())
    return {"qemu_cpu_s": round(qemu_cpu, 2), "cgroup_cpu_s": round(usage / 1e9, 2),
            "cpu_ratio": round(usage / 1e9 / qemu_cpu, 4) if qemu_cpu else 0.0,
            "qemu_rss_mib": round(rss, 1), "qemu_anon_mib": round(anon, 1),
            "cgroup_memory_mib": round(memory / (1 << 20), 1)}
