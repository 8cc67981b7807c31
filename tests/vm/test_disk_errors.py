"""The scratch disk's errors are its guest's (docs/design.md, "A VM that stops answering"):
QEMU reports them to the guest instead of pausing the VM, which QEMU's default for writes
(`enospc`) does when the host's file system is full. The guest's side is
tests/e2e/test_unanswering_vm.py's; here, the command line and the template key."""
from __future__ import annotations

from shim.vm.qemu import command
from shim.vm.template import template as templates

from .test_template import files_spec


def scratch_device(cmd: list[str]) -> list[str]:
    [device] = [cmd[i + 1] for i, arg in enumerate(cmd[:-1])
                if arg == "-device" and cmd[i + 1].startswith("virtio-blk-pci,")]
    return device.split(",")


def test_the_scratch_disk_reports_its_errors_to_the_guest(tmp_path) -> None:
    device = scratch_device(command.command(files_spec(tmp_path, scratch_disk="/proc/self/fd/7")))
    assert {"werror=report", "rerror=report", f"drive={command.SCRATCH}"} <= set(device)


def test_a_template_saved_with_another_error_policy_is_not_this_one(tmp_path,
                                                                    monkeypatch) -> None:
    spec = files_spec(tmp_path, scratch_disk="/proc/self/fd/7")
    key = templates.of(spec).key
    made_before = command._scratch

    def without_policy(s):  # the command line before the policy was set: QEMU's default
        return [",".join(p for p in arg.split(",") if not p.endswith("error=report"))
                for arg in made_before(s)]

    monkeypatch.setattr(command, "_scratch", without_policy)
    assert "werror=report" not in ",".join(command.command(spec))
    assert templates.of(spec).key != key
