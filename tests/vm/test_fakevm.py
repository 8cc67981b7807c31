"""The tests' FakeVM (testbed/fakevm.py) holds to the hypervisor interface as QEMU's driver
does, so that a test run on it proves about the host what the same test on QEMU proved:
it is a VM; its process is real, runs the `preexec` it is given and is found by `delete`
as a QEMU; its threads are real, named as QEMU's and where threads() says; vCPUs and
memory grow within QEMU's slots (new vCPU threads are real); stop, exits, `dead` and
`exited` behave as the interface's docstrings say; its agent answers every call of
shim/vm/agent.py as the guest's does, running real processes. And it cannot be selected
where testbed/ is not installed, which no node has."""
from __future__ import annotations

import asyncio
import inspect
import json
import os
import pathlib
import signal
import sys
import tomllib
from types import SimpleNamespace

import psutil
import pytest

from podvm_core.ttrpc import Code, TtrpcError
from podvm_node import bundle_python
from shim.config import HypervisorConfig
from shim.host.cleanup import qemus_of
from shim.vm import vmm
from shim.vm.agent import Agent
from shim.vm.hypervisor import CannotGrow, HypervisorError, ThreadRole, VM, VMExited, VMSpec
from shim.vm.qemu.driver import QemuVM
from shim.vm.stdio import Stdio
from testbed.fakevm import FakeVM
from testbed.taskshim import busybox_rootfs

ROOT = pathlib.Path(__file__).resolve().parents[2]
PIPES = Stdio(stdin=True, stdout=True, stderr=True, terminal=False)
NONE = Stdio(False, False, False, False)


def spec(tmp_path: pathlib.Path, accel: str = "tcg", vcpus: int = 1, max_vcpus: int = 2,
         memory: int = 256, max_memory: int = 1024) -> VMSpec:
    return VMSpec(sandbox_id="fake-" + tmp_path.name[-12:], workdir=str(tmp_path / "vm"),
                  shared_dir=str(tmp_path), vcpus=vcpus, max_vcpus=max_vcpus,
                  memory_mib=memory, max_memory_mib=max_memory,
                  hypervisor=HypervisorConfig(accel=accel, boot_timeout=60))


@pytest.fixture
async def vm(tmp_path):
    made: list[FakeVM] = []

    async def launch(**kw) -> FakeVM:
        v = FakeVM(spec(tmp_path, **kw))
        made.append(v)
        await v.launch()
        return v

    yield launch
    for v in made:
        await v.stop(timeout=2)


def comm(pid: int, tid: int) -> str:
    return pathlib.Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()


def oci(args: list[str]) -> bytes:
    return json.dumps({"process": {"args": args, "env": ["PATH=/bin:/usr/bin"],
                                   "cwd": "/"}, "root": {"path": "/"}}).encode()


async def test_it_is_a_vm_of_the_interface(tmp_path) -> None:
    fake = FakeVM(spec(tmp_path))
    assert isinstance(fake, VM) and not inspect.isabstract(FakeVM)
    assert fake.control_socket in fake.command() and "qemu" in fake.command()[0]
    fake.check_files()


async def test_its_process_runs_preexec_and_delete_finds_it_as_a_qemu(tmp_path) -> None:
    mark = tmp_path / "preexec"
    fake = FakeVM(spec(tmp_path))
    await fake.launch(preexec=lambda: mark.write_text(str(os.getpid())))
    try:
        assert int(mark.read_text()) == fake.pid  # in the child, before exec
        assert qemus_of(str(tmp_path / "vm") + "/") == [fake.pid]  # shim/host/cleanup.py
    finally:
        await fake.stop()


async def test_its_threads_are_real_named_as_qemu_s_and_where_threads_says(vm) -> None:
    fake = await vm(vcpus=1, max_vcpus=3)
    roles = await fake.threads()
    tasks = {t.id for t in psutil.Process(fake.pid).threads()}
    assert roles[ThreadRole.MAIN] == [fake.pid]
    # under TCG every vCPU the VM may have is present from boot (shim/vm/qemu/command.py)
    assert [comm(fake.pid, t) for t in roles[ThreadRole.VCPU]] == \
        ["CPU 0/TCG", "CPU 1/TCG", "CPU 2/TCG"]
    assert "call_rcu" in [comm(fake.pid, t) for t in roles[ThreadRole.OTHER]]
    assert {t for ts in roles.values() for t in ts} == tasks
    assert await fake.size() == (3, 256)
    with pytest.raises(CannotGrow):  # no free slot under TCG, as QEMU's
        await fake.add_vcpus(1)


async def test_vcpus_and_memory_hot_plugged_within_qemu_s_slots(vm) -> None:
    fake = await vm(accel="kvm", vcpus=1, max_vcpus=3, memory=256, max_memory=512)
    assert await fake.size() == (1, 256)
    added = await fake.add_vcpus(2)
    assert len(added) == 2 and set(added) <= {t.id for t in psutil.Process(fake.pid).threads()}
    assert [comm(fake.pid, t) for t in added] == ["CPU 1/KVM", "CPU 2/KVM"]
    assert (await fake.threads())[ThreadRole.VCPU][1:] == added
    with pytest.raises(CannotGrow):
        await fake.add_vcpus(1)
    assert await fake.add_memory(128) == 128
    assert await fake.size() == (3, 384)
    with pytest.raises(CannotGrow):  # above maxmem
        await fake.add_memory(256)


async def test_stop_quits_it_and_kills_one_that_does_not(vm) -> None:
    fake = await vm()
    assert not fake.dead() and await fake.exited() is None
    await fake.stop()
    assert fake.dead() and await fake.wait() == 0
    assert "exited with status 0 while the pod was running" in str(await fake.exited())
    await fake.stop()  # a no-op once gone
    stuck = await vm()
    os.kill(stuck.pid, signal.SIGSTOP)  # answers nothing, ends on nothing but SIGKILL
    await stuck.stop(timeout=0.5)
    assert stuck.dead() and await stuck.wait() == -signal.SIGKILL


async def test_a_killed_vm_is_dead_and_says_how_it_ended(vm) -> None:
    fake = await vm()
    agent = Agent.of_vm(fake)
    await agent.create_container("c", oci(["sleep", "1000"]), NONE, sandbox=False)
    child = await agent.start_container("c")
    os.kill(fake.pid, signal.SIGKILL)
    gone = await fake.exited(grace=5)
    assert isinstance(gone, VMExited) and fake.dead()
    assert f"(pid {fake.pid}) of sandbox {fake.spec.sandbox_id} was killed by signal " \
           f"SIGKILL while the pod was running" in str(gone)
    await asyncio.sleep(0.2)
    assert not psutil.pid_exists(child) or \
        psutil.Process(child).status() == psutil.STATUS_ZOMBIE  # went with its VM
    with pytest.raises(TtrpcError) as err:
        await agent.ping()
    assert err.value.code == Code.UNAVAILABLE
    await agent.close()


async def test_a_vmm_that_dies_at_start_fails_the_launch(tmp_path, monkeypatch) -> None:
    fake = FakeVM(spec(tmp_path))
    monkeypatch.setattr(fake, "command", lambda: [sys.executable, "-c", "exit(3)"])
    with pytest.raises(VMExited, match="exited with status 3 before the guest came up"):
        await fake.launch()
    assert fake.dead()


async def status_becomes(pid: int, status: str) -> bool:
    for _ in range(100):  # a signal is delivered when the process is next scheduled
        if psutil.Process(pid).status() == status:
            return True
        await asyncio.sleep(0.02)
    return False


async def _every_call(fake: FakeVM, agent: Agent, asked: set[str]) -> None:
    """Each call of shim/vm/agent.py answered as the guest's agent answers it."""
    def ask(name: str):
        asked.add(name)
        return getattr(agent, name)

    assert (await ask("ping")()).online_cpus == 1
    await ask("resume_restored")({})
    holder = await ask("create_pod_namespaces")("pod", {"kernel.shm_rmid_forced": "1"})
    assert psutil.Process(holder).ppid() == fake.pid
    await ask("configure_network")(SimpleNamespace(interfaces=[], routes=[]))
    online = await ask("online")(2)
    assert online.online_cpus == 2 and (await agent.ping()).online_cpus == 2
    assert await ask("grow_scratch")(256 << 20) == 256 << 20
    await ask("create_container")("c1", oci(["sh", "-c", "echo hi; read x; echo got $x; "
                                              "exit 7"]), PIPES, sandbox=False)
    await ask("start_container")("c1")
    assert await ask("write_stdin")("c1", "", b"there\n") == 6
    await ask("close_stdin")("c1", "")
    out = b""
    while chunk := await ask("read")("stdout", "c1", ""):
        out += chunk
    assert out == b"hi\ngot there\n"
    assert (await ask("wait")("c1", "")).exit_status == 7
    await ask("remove")("c1")
    pid = await agent.create_container("c2", oci(["sleep", "1000"]), NONE, sandbox=False)
    await agent.start_container("c2")
    assert psutil.Process(pid).ppid() == fake.pid and \
        psutil.Process(pid).cmdline()[-2:] == ["sleep", "1000"]
    assert [p.pid for p in await ask("pids")("c2")] == [pid]
    assert (await ask("stats")("c2")).type_url.endswith("Metrics")
    await ask("update")("c2", b'{"cpu": {"shares": 2}}')
    await ask("pause")("c2")
    assert await status_becomes(pid, psutil.STATUS_STOPPED)
    await ask("resume")("c2")
    assert await status_becomes(pid, psutil.STATUS_SLEEPING)
    await ask("exec_process")("c2", "e1", json.dumps({"args": ["sh", "-c", "exit 3"]}).encode(),
                              NONE)
    assert (await agent.wait("c2", "e1")).exit_status == 3
    await ask("remove_process")("c2", "e1")
    await ask("signal")("c2", "", signal.SIGKILL, True)
    assert (await agent.wait("c2", "")).exit_status == 128 + signal.SIGKILL
    await agent.remove("c2")
    await agent.create_container("t", oci(["sh"]), Stdio(True, True, False, True), False)
    await ask("resize")("t", "", 100, 30)
    await agent.remove("t")
    with pytest.raises(TtrpcError) as err:
        await ask("open_port_forward")(80)
    assert err.value.code == Code.UNAVAILABLE
    for name, call in (("read_port_forward", (1,)), ("write_port_forward", (1, b"x")),
                       ("close_port_forward", (1,))):
        with pytest.raises(TtrpcError) as err:
            await ask(name)(*call)
        assert err.value.code == Code.NOT_FOUND
    await fake.oom("c9")
    assert await ask("oom_event")() == "c9"
    await ask("shutdown")()


async def test_the_agent_answers_every_call_the_shim_makes(vm) -> None:
    """A call added to shim/vm/agent.py that the fake does not answer fails here."""
    fake = await vm()
    agent = Agent.of_vm(fake)
    asked: set[str] = set()
    await _every_call(fake, agent, asked)
    public = {name for name, fn in inspect.getmembers(Agent, inspect.iscoroutinefunction)
              if not name.startswith("_")} - {"close"}
    assert asked == public
    assert await asyncio.wait_for(fake.wait(), 10) == 0  # Shutdown powers it off
    await agent.close()


def test_vmm_creates_it_only_where_the_environment_names_it(tmp_path, monkeypatch) -> None:
    s = spec(tmp_path)
    monkeypatch.delenv(vmm.TEST_VMM, raising=False)
    assert isinstance(vmm.create(s), QemuVM)
    monkeypatch.setenv(vmm.TEST_VMM, "fake")
    assert isinstance(vmm.create(s), FakeVM)
    monkeypatch.setenv(vmm.TEST_VMM, "qemu-but-different")
    with pytest.raises(HypervisorError, match="names no VMM"):
        vmm.create(s)


def test_without_testbed_the_selection_fails_and_nothing_boots(tmp_path, monkeypatch) -> None:
    """A node has no testbed/: PODVM_TEST_VMM=fake there is an error, not a VM."""
    monkeypatch.setenv(vmm.TEST_VMM, "fake")
    monkeypatch.setitem(sys.modules, "testbed.fakevm", None)  # as if not installed
    with pytest.raises(HypervisorError, match="not installed here.*nothing was booted"):
        vmm.create(spec(tmp_path))
    assert not (tmp_path / "vm").exists()


def test_testbed_is_shipped_in_neither_the_wheel_nor_the_node_bundle() -> None:
    found = tomllib.loads((ROOT / "pyproject.toml").read_text())
    include = found["tool"]["setuptools"]["packages"]["find"]["include"]
    assert not any("testbed".startswith(p.rstrip("*")) for p in include), include
    assert "testbed" not in bundle_python.PACKAGES



async def test_a_program_the_container_root_lacks_is_refused_as_runc_does(vm) -> None:
    """The root is the share's, as the guest has it (VMSpec.shared_dir here): a program
    it has runs (the host's), one it lacks is runc's FAILED_PRECONDITION."""
    fake = await vm()
    busybox_rootfs(pathlib.Path(fake.spec.shared_dir) / "c" / "rootfs")
    agent = Agent.of_vm(fake)
    in_share = json.dumps({"process": {"args": ["sh", "-c", "exit 4"], "env": ["PATH=/bin"]},
                           "root": {"path": "/run/podvm/shared/c/rootfs"}}).encode()
    await agent.create_container("c", in_share, NONE, sandbox=False)
    await agent.start_container("c")
    assert (await agent.wait("c", "")).exit_status == 4
    lacking = in_share.replace(b'"sh", "-c", "exit 4"', b'"/no/such/binary"')
    with pytest.raises(TtrpcError) as err:
        await agent.create_container("d", lacking, NONE, sandbox=False)
    assert err.value.code == Code.FAILED_PRECONDITION and "/no/such/binary" in err.value.message
    await agent.close()
