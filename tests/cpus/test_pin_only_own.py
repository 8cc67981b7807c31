"""The thread ids QMP reports are QEMU's word: a QEMU a guest took over names another
process's threads (containerd's, another pod's vCPUs) as its vCPUs, and the shim must
not place or pin them (shim/vm/qemu/query.py checks them against /proc/<qemu>/task,
shim/cpus/pinning.py again just before each affinity is set)."""
from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from shim.config import HypervisorConfig
from shim.cpus import pinning
from shim.cpus.vmthreads import VMThreads
from shim.vm.hypervisor import HypervisorError, ThreadRole, VMSpec
from shim.vm.qemu.driver import QemuVM

THREADED = ("import threading, time\n"
            "for _ in range(2): threading.Thread(target=time.sleep, args=(600,), "
            "daemon=True).start()\n"
            "print('up', flush=True)\n"
            "time.sleep(600)\n")


@pytest.fixture
def processes():
    """A QEMU stand-in and a process standing for containerd, each with three threads."""
    started = []

    def start() -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", THREADED], stdout=subprocess.PIPE)
        assert proc.stdout.readline() == b"up\n"
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.kill()
        proc.wait()


def tasks(pid: int) -> list[int]:
    return sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))


class QMP:
    """QMP as the stand-in answers it: `vcpus` as the vCPUs' thread ids."""

    def __init__(self, vcpus: list[int], iothreads: list[int] = ()) -> None:
        self.vcpus, self.iothreads = vcpus, list(iothreads)

    async def execute(self, command: str, arguments: dict | None = None) -> object:
        if command == "query-cpus-fast":
            return [{"cpu-index": i, "thread-id": t} for i, t in enumerate(self.vcpus)]
        if command == "query-iothreads":
            return [{"id": f"io{i}", "thread-id": t} for i, t in enumerate(self.iothreads)]
        raise AssertionError(command)


def vm_of(qemu: subprocess.Popen, qmp: QMP, tmp_path) -> QemuVM:
    vm = QemuVM(VMSpec(sandbox_id="lying", workdir=str(tmp_path), shared_dir=str(tmp_path),
                       vcpus=1, max_vcpus=1, memory_mib=256, max_memory_mib=256,
                       hypervisor=HypervisorConfig()))
    vm._proc, vm._qmp = qemu, qmp  # type: ignore[assignment]
    return vm


PLAN = SimpleNamespace(cpuset="0", vcpus=1)
"""What pin() reads: the pod's cpuset is CPU 0, its one vCPU pinned."""


def vm_threads() -> VMThreads:
    return VMThreads("lying", cgroup=None, pin_vcpus=True,  # type: ignore[arg-type]
                     record=lambda **fields: None)


def affinities(pid: int) -> dict[int, set[int]]:
    return {tid: os.sched_getaffinity(tid) for tid in tasks(pid)}


async def test_a_qmp_that_names_another_process_s_threads_gets_nothing_pinned(
        processes, tmp_path) -> None:
    assert len(os.sched_getaffinity(0)) >= 2, "pinning to CPU 0 must be a change"
    qemu, containerd = processes(), processes()
    victim = tasks(containerd.pid)[1]
    before = affinities(containerd.pid)
    assert before[victim] != {0}
    vm = vm_of(qemu, QMP(vcpus=[victim], iothreads=[containerd.pid]), tmp_path)
    with pytest.raises(HypervisorError) as err:
        await vm_threads().pin(vm, PLAN)
    message = str(err.value)
    assert f"QEMU (pid {qemu.pid}) reported thread ids that are not its own" in message
    assert f"{containerd.pid}, {victim}" in message or \
        f"{victim}, {containerd.pid}" in message  # each named
    assert affinities(containerd.pid) == before  # nothing of containerd's was pinned
    with pytest.raises(HypervisorError, match=str(victim)):
        await vm.threads()  # what placement in the sandbox cgroup asks for too


async def test_a_qmp_that_tells_the_truth_has_its_vcpu_pinned(processes, tmp_path) -> None:
    """The control: QEMU's own thread is pinned to the pod's CPU."""
    qemu = processes()
    own = tasks(qemu.pid)[1]
    vm = vm_of(qemu, QMP(vcpus=[own]), tmp_path)
    await vm_threads().pin(vm, PLAN)
    assert os.sched_getaffinity(own) == {0}
    roles = await vm.threads()
    assert roles[ThreadRole.VCPU] == [own] and roles[ThreadRole.MAIN] == [qemu.pid]
    assert sorted(roles[ThreadRole.OTHER]) == [t for t in tasks(qemu.pid)
                                               if t not in (own, qemu.pid)]


def test_apply_skips_an_id_that_is_no_longer_the_owner_s(processes) -> None:
    """Between the check and the pin a QEMU thread may end and its id be another's."""
    qemu, containerd = processes(), processes()
    own, other = tasks(qemu.pid)[1], tasks(containerd.pid)[1]
    before = os.sched_getaffinity(other)
    seen = pinning.apply({own: frozenset({0}), other: frozenset({0})}, owner=qemu.pid)
    assert seen == {own: frozenset({0})}
    assert os.sched_getaffinity(other) == before
