"""The guest kernel keeps its own defences by default: what a container that has broken
out to guest root finds in the guest kernel, booted with the line QemuVM gives it; the
fast form only where the configuration asks for it; nothing a pod sends can weaken it."""
from __future__ import annotations

import dataclasses
import pathlib

import pytest

from shim.config import ConfigError, HypervisorConfig, parse
from shim.vm.qemu.command import FAST_PARAMS, TEMPLATE_PARAM, kernel_line
from shim.vm.qemu.driver import QemuVM
from shim.resources.annotations import KATA, apply_kata_overrides
from shim.resources.model import PlanError
from tests.guestprobe import run_probe
from tests.vm.test_qemu import spec

WEAK = FAST_PARAMS.split()
PROBE = r"""
mount -t sysfs sysfs /sys
mount -t securityfs securityfs /sys/kernel/security
echo "PROBE cmdline $(cat /proc/cmdline)"
echo "PROBE lsm $(cat /sys/kernel/security/lsm)"
echo "PROBE spectre_v2 $(cat /sys/devices/system/cpu/vulnerabilities/spectre_v2)"
dmesg | grep 'mem auto-init' | sed 's/^.*mem auto-init:/PROBE auto-init/'
echo 1 > /proc/sys/kernel/kptr_restrict
grep ' T _text$' /proc/kallsyms | sed 's/^/PROBE text /'
"""


def kernel_append(tmp_path: pathlib.Path, **qemu: object) -> str:
    argv = QemuVM(spec(tmp_path, **qemu)).command()
    return argv[argv.index("-append") + 1]


def probe(tmp_path: pathlib.Path, append: str) -> dict[str, str]:
    """What the guest kernel booted with `append` says, by PROBE line."""
    out = run_probe(tmp_path, PROBE, params=append)
    found = {}
    for line in out.splitlines():
        if line.startswith("PROBE "):
            key, _, value = line[len("PROBE "):].partition(" ")
            found[key] = value
    assert {"cmdline", "lsm", "spectre_v2", "auto-init", "text"} <= found.keys(), out[-3000:]
    return found


def test_default_line_has_no_weakening_and_the_fast_form_only_when_asked(tmp_path) -> None:
    hardened = kernel_append(tmp_path).split()
    assert not set(WEAK) & set(hardened), hardened
    fast = kernel_append(tmp_path, guest_kernel_hardening=False).split()
    assert set(WEAK) <= set(fast)
    extra = kernel_append(tmp_path, kernel_params="slub_debug=F").split()
    assert "slub_debug=F" in extra and extra[-1].startswith("maxcpus="), extra


def test_template_marker_and_maxcpus_come_after_the_operators_parameters(tmp_path) -> None:
    """The kernel keeps the last of a repeated parameter: podvm's own come last."""
    s = spec(tmp_path, kernel_params="quiet")
    s = dataclasses.replace(s, template=True)
    words = QemuVM(s).command()
    words = words[words.index("-append") + 1].split()
    assert words.index("quiet", words.index("noreplace-smp")) < words.index(TEMPLATE_PARAM) \
        < words.index(next(w for w in words if w.startswith("maxcpus=")))


def test_guest_kernel_keeps_its_defences(tmp_path) -> None:
    """Booted as a pod's VM is by default: mitigations on (under TCG's `-cpu max` only
    Spectre v1/v2 apply: the rest say "Not affected"), Debian's LSMs, zeroed heap
    allocations. The kernel is not relocated (PVH skips the decompressor that does
    KASLR): what shim/vm/qemu/diagnosis.py's vcpu_positions relies on."""
    found = probe(tmp_path, kernel_append(tmp_path).replace(" quiet", ""))
    assert not set(WEAK) & set(found["cmdline"].split()), found["cmdline"]
    assert found["spectre_v2"].startswith("Mitigation: "), found
    assert {"landlock", "yama", "apparmor"} <= set(found["lsm"].split(",")), found
    assert "heap alloc:on" in found["auto-init"], found
    assert found["text"].startswith("ffffffff81000000 "), found


def test_fast_form_turns_them_off(tmp_path) -> None:
    """The same probe fails on the old line: the defences test above can fail."""
    found = probe(tmp_path, kernel_append(tmp_path, guest_kernel_hardening=False))
    assert found["spectre_v2"].startswith("Vulnerable"), found
    assert not {"landlock", "yama", "apparmor"} & set(found["lsm"].split(",")), found
    assert "heap alloc:off" in found["auto-init"], found


@pytest.mark.parametrize("params", [
    "console=ttyS1", "panic=0", "reboot=w", "maxcpus=64", "nr_cpus=64", "possible-cpus=64",
    "init=/bin/sh", "rdinit=/bin/sh", "root=/dev/vda", "podvm_template=1",
    "podvm-template=1", '"console=ttyS1"', "-- --debug", "mitigations=auto\ninit=/bin/sh",
])
def test_kernel_params_cannot_take_what_podvm_relies_on(params) -> None:
    with pytest.raises(ConfigError) as err:
        parse({"hypervisor": {"qemu": {"kernel_params": params}}}, "/etc/x.toml")
    assert "kernel_params" in str(err.value) and "/etc/x.toml" in str(err.value)


def test_a_pod_cannot_set_kernel_parameters_even_when_annotations_are_enabled() -> None:
    """A pod's author playing Kata's annotation: the VM's kernel line is the node's."""
    with pytest.raises(PlanError) as err:
        apply_kata_overrides(None,  # type: ignore[arg-type]  (refused before it is read)
                             {KATA + "kernel_params": "mitigations=off nokaslr"},
                             ("kernel_params", "default_vcpus"), "/etc/x.toml")
    assert "not supported" in str(err.value)


def test_bench_rows_each_add_back_one_defence_alone() -> None:
    """bench/hardening_bench.py's rows are the kernel lines they are named after."""
    from bench.hardening_bench import DEFENCES, configurations  # it imports the e2e harness

    rows = configurations()
    weak = set(FAST_PARAMS.split())
    for name, param in DEFENCES.items():
        line = set(kernel_line(HypervisorConfig(**rows[f"  + {name} alone"]), False).split())
        assert line & weak == weak - {param}, (name, line & weak)
    assert set(kernel_line(HypervisorConfig(**rows["after: the defaults"]), False).split()) \
        .isdisjoint(weak)
