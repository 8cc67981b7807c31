"""Templates (shim/vm/template.py): which VMs share one (the key), what is kept
and pruned in template_path, and, on a real QEMU under TCG, a template made, restored
twice and resumed, and a state that does not fit the VM refused as RestoreFailed."""
from __future__ import annotations

import dataclasses
import errno
import json
import os
import pathlib

import psutil
import pytest

from shim.vm.agent import Agent
from shim.vm.hypervisor import RestoreFailed, VMSpec
from shim.vm import stateload
from shim.vm import template as templates
from shim.vm.qemu import QemuVM
from shim.vm.stateload import reader_command
from shim.network.model import TapNic
from tests.conftest import require_root
from tests.vmconfig import vm_config


def files_spec(tmp_path: pathlib.Path, **changes) -> VMSpec:
    """A spec over stand-in files: the key reads only their identity."""
    for name in ("qemu", "vmlinux", "initrd", "rootfs"):
        path = tmp_path / name
        if not path.exists():
            path.write_bytes(b"\0" * 4096)
    cfg = vm_config(path=str(tmp_path / "qemu"), kernel=str(tmp_path / "vmlinux"),
                    initrd=str(tmp_path / "initrd"), image=str(tmp_path / "rootfs"),
                    template_path=str(tmp_path / "store"))
    base = VMSpec(sandbox_id="a", workdir=str(tmp_path / "a" / "vm"),
                  shared_dir=str(tmp_path / "a" / "shared"), vcpus=1, max_vcpus=2,
                  memory_mib=256, max_memory_mib=1024, hypervisor=cfg.qemu)
    return dataclasses.replace(base, **changes)


def nic(index: int, mac: str, mtu: int = 1500, fd: int = 10) -> TapNic:
    return TapNic(index=index, interface=f"eth{index}", tap=f"tap{index}", mac=mac, mtu=mtu,
                  tap_fd=fd)


def test_pods_of_one_shape_share_a_key_and_other_shapes_do_not(tmp_path) -> None:
    one = templates.of(files_spec(tmp_path, nics=(nic(0, "0a:00:00:00:00:01"),)))
    # Another pod: its own id, directories, tap and MAC.
    other = templates.of(files_spec(
        tmp_path, sandbox_id="b", workdir=str(tmp_path / "b" / "vm"),
        shared_dir=str(tmp_path / "b" / "shared"),
        nics=(nic(0, "0a:00:00:00:00:02", fd=12),)))
    assert one.key == other.key and one.directory == str(tmp_path / "store")
    differ = [
        files_spec(tmp_path, nics=(nic(0, "0a:00:00:00:00:01", mtu=9000),)),
        files_spec(tmp_path, nics=()),
        files_spec(tmp_path, nics=(nic(0, "0a:00:00:00:00:01"), nic(1, "0a:00:00:00:00:03"))),
        files_spec(tmp_path, vcpus=2, nics=(nic(0, "0a:00:00:00:00:01"),)),
        files_spec(tmp_path, memory_mib=512, nics=(nic(0, "0a:00:00:00:00:01"),)),
        files_spec(tmp_path, max_memory_mib=2048, nics=(nic(0, "0a:00:00:00:00:01"),)),
    ]
    keys = {templates.of(s).key for s in differ}
    assert len(keys) == len(differ) and one.key not in keys
    # A new guest image is a new key.
    os.utime(tmp_path / "initrd", ns=(1, 1))
    assert templates.of(files_spec(tmp_path, nics=(nic(0, "0a:00:00:00:00:01"),))).key != one.key


def test_prune_removes_templates_of_changed_files_and_states_without_metadata(tmp_path) -> None:
    current = templates.of(files_spec(tmp_path))
    store = pathlib.Path(current.directory)
    store.mkdir()
    for key, inputs in ((current.key, current.inputs),
                        ("old", {**current.inputs, "kernel": [str(tmp_path / "vmlinux"), 1, 2, 3]}),
                        ("gone", {"qemu": [str(tmp_path / "nowhere"), 1, 2, 3]})):
        (store / f"{key}.json").write_text(json.dumps({"format": templates.FORMAT,
                                                        "inputs": inputs}))
        (store / f"{key}.vmstate").write_bytes(b"state")
        (store / f"{key}.vmstate.ram").write_bytes(b"memory")
    (store / "torn.vmstate").write_bytes(b"half")
    (store / "torn2.vmstate.ram").write_bytes(b"half")
    (store / "garbled.json").write_text("{")
    assert sorted(templates.prune(str(store))) == ["garbled", "gone", "old"]
    assert sorted(os.listdir(store)) == [f"{current.key}.json", f"{current.key}.vmstate",
                                         f"{current.key}.vmstate.ram"]
    assert current.exists()


def test_one_maker_at_a_time(tmp_path) -> None:
    t = templates.of(files_spec(tmp_path))
    first = t.lock()
    assert first is not None
    try:
        assert t.lock() is None
    finally:
        first.release()
    again = t.lock()
    assert again is not None
    again.release()


def test_a_state_is_read_past_the_page_cache_or_dropped_after(tmp_path, monkeypatch) -> None:
    on_disk = tmp_path / "state"
    on_disk.write_bytes(b"x" * 8192)
    assert reader_command(str(on_disk)) == ["dd", f"if={on_disk}", "bs=4M", "iflag=direct",
                                            "status=none"]
    with pytest.raises(RestoreFailed, match="cannot read the template"):
        reader_command(str(tmp_path / "discarded-meanwhile"))

    # A file system without O_DIRECT (tmpfs before Linux 6.6; this machine's has it)
    # refuses the open with EINVAL: dd then drops what it read from the page cache.
    def no_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    real_open = os.open
    monkeypatch.setattr(os, "open", no_direct)
    assert reader_command(str(on_disk)) == ["dd", f"if={on_disk}", "bs=4M", "iflag=nocache",
                                            "status=none"]


def vm_spec(tmp_path: pathlib.Path, name: str, **changes) -> VMSpec:
    require_root()
    cfg = vm_config(template_path=str(tmp_path / "store"))
    (tmp_path / name / "shared").mkdir(parents=True, exist_ok=True)
    spec = VMSpec(sandbox_id=name, workdir=str(tmp_path / name / "vm"),
                  shared_dir=str(tmp_path / name / "shared"), vcpus=1, max_vcpus=2,
                  memory_mib=256, max_memory_mib=1024, hypervisor=cfg.qemu)
    return dataclasses.replace(spec, **changes)


async def test_made_restored_twice_and_resumed_on_a_real_qemu(tmp_path) -> None:
    spec = vm_spec(tmp_path, "maker")
    template = templates.of(spec)
    await template.make(spec, None)
    assert template.exists() and not os.path.exists(spec.workdir + "-template")
    assert json.loads(open(template.meta).read())["made_by"] == "maker"
    for name in ("one", "two"):
        pod = vm_spec(tmp_path, name, template=True)
        assert templates.of(pod).key == template.key
        vm = QemuVM(pod)
        await vm.launch(restore_from=template.state)
        try:
            agent = Agent.of_vm(vm)
            await agent.resume_restored({}, timeout=30)
            info = await agent.ping(timeout=30)
            assert info.online_cpus == 1 and info.memory_total_bytes > 128 << 20
            await agent.close()
        finally:
            await vm.stop()


async def test_a_state_that_does_not_fit_the_vm_is_restore_failed(tmp_path) -> None:
    spec = vm_spec(tmp_path, "maker")
    template = templates.of(spec)
    await template.make(spec, None)
    vm = QemuVM(vm_spec(tmp_path, "bigger", template=True, memory_mib=512))
    with pytest.raises(RestoreFailed, match="did not restore") as err:
        await vm.launch(restore_from=template.state)
    assert template.state in str(err.value)
    assert vm.dead()


@pytest.mark.parametrize("reader", [
    ["dd", "if=/nonexistent/template.vmstate", "status=none"],  # dd fails at once
    ["sh", "-c", "head -c 65536 \"$0\"; exit 3"],  # half a state, then dd dies
])
async def test_a_reader_that_fails_is_restore_failed(tmp_path, monkeypatch, reader) -> None:
    """QEMU loads through a pipe from the shim's dd (its seccomp filter forbids running
    one itself): dd failing, before or in the middle of the state, fails the restore
    as RestoreFailed (the pod then boots) and leaves no dd behind."""
    spec = vm_spec(tmp_path, "maker")
    template = templates.of(spec)
    await template.make(spec, None)
    monkeypatch.setattr(stateload, "reader_command",
                        lambda path: [*reader, path] if reader[0] == "sh" else reader)
    vm = QemuVM(vm_spec(tmp_path, "pod", template=True))
    before = _live_children()  # the run's own (multiprocessing's resource tracker...)
    with pytest.raises(RestoreFailed) as err:
        await vm.launch(restore_from=template.state)
    assert template.state in str(err.value)
    assert vm.dead()
    assert _live_children() - before == set()


def _live_children() -> set[int]:
    return {c.pid for c in psutil.Process().children(recursive=True)
            if c.is_running() and c.status() != psutil.STATUS_ZOMBIE}


async def test_a_template_gone_before_the_load_is_restore_failed(tmp_path) -> None:
    spec = vm_spec(tmp_path, "maker")
    template = templates.of(spec)
    await template.make(spec, None)
    os.unlink(template.state)
    vm = QemuVM(vm_spec(tmp_path, "pod", template=True))
    with pytest.raises(RestoreFailed, match="cannot read the template"):
        await vm.launch(restore_from=template.state)
    assert vm.dead()
