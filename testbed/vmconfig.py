"""The guest image the tests boot, and a podvm configuration that uses it under TCG
(a guest kernel hangs under nested KVM on our machines)."""
from __future__ import annotations

import asyncio
import atexit
import json
import os
import pathlib
import shutil
import tempfile

from shim.config import Config, HypervisorConfig, RuntimeConfig, load
from shim.vm.template import maker as templatemaker

from .cgroupdirs import cgroup_dirs, remove_below
from .prereqs import require, require_tool

ROOT = pathlib.Path(__file__).resolve().parents[1]
# PODVM_GUEST_DIR: another image (one being built and tried beside the default one)
GUEST = pathlib.Path(os.environ.get("PODVM_GUEST_DIR") or ROOT / "build" / "guest")
RUST_VIRTIOFSD = ROOT / "build" / "virtiofsd" / "virtiofsd"
QEMU_VIRTIOFSD = "/usr/lib/qemu/virtiofsd"
VIRTIOFS_DAEMONS = ("qemu-7.2", "rust")
"""The virtiofsds podvm speaks to (shim/vm/virtiofsd.py), by virtiofs_daemon()'s names."""
# The templates pods of this run make and restore (shim/vm/template/template.py): this
# process's own, removed by remove_templates() when it exits (a test run or a bench).
TEMPLATES = pathlib.Path(tempfile.gettempdir()) / f"podvm-templates-{os.getpid()}"
TEMPLATE_CGROUP = f"/podvm-test-templates-{os.getpid()}"
"""Where this run's templates are made and cached (shim/vm/template/maker.py, cache.py):
removed with them."""
_OWNER = os.getpid()


def remove_templates() -> None:
    shutil.rmtree(TEMPLATES, ignore_errors=True)
    shutil.rmtree(f"{TEMPLATES}-scratch", ignore_errors=True)
    # each template's own cgroup went with its VM; what is left, the page cache's
    # (shim/vm/template/cache.py), holds pages and no process: deepest first
    for top in cgroup_dirs(TEMPLATE_CGROUP.strip("/")):
        try:
            remove_below(top)
        except OSError:
            pass


@atexit.register
def _remove_own_templates() -> None:
    if os.getpid() == _OWNER:  # not a forked child's, which names the same ones
        remove_templates()


VMMS = ("qemu", "fake")
"""What a shim a test starts may run its pods' VMs with: QEMU and the real guest image, or
testbed/fakevm.py's FakeVM (a host process and an agent that answers, no guest), for
the tests of what the host does with a VM."""
TEST_VMM = "PODVM_TEST_VMM"
"""shim/vm/vmm.py's variable that selects the FakeVM."""


def vmm_env(env: dict[str, str], vmm: str) -> dict[str, str]:
    """`env` for a shim whose VMs `vmm` (VMMS) makes: "fake" sets TEST_VMM, "qemu" clears
    it (a test's own environment never picks the VMM)."""
    assert vmm in VMMS, vmm
    env = {k: v for k, v in env.items() if k != TEST_VMM}
    return {**env, TEST_VMM: "fake"} if vmm == "fake" else env


def vmm_config(vmm: str) -> dict[str, object]:
    """The configuration keys a VMM needs besides the tests' own: a FakeVM restores and
    makes no template."""
    return {"enable_template": False} if vmm == "fake" else {}


def guest_image() -> tuple[str, str]:
    require_tool("qemu-system-x86_64", "qemu-system-x86")
    kernel, initrd = GUEST / "vmlinux", GUEST / "initrd.img"
    require(kernel.is_file() and initrd.is_file(), f"the guest image in {GUEST} (make guest)")
    return str(kernel), str(initrd)


def root_image() -> str:
    """The guest's root filesystem, which the initramfs mounts (virtio-pmem)."""
    image = GUEST / "rootfs.img"
    require(image.is_file(), f"the guest root image {image} (make guest)")
    return str(image)


def rust_virtiofsd() -> str:
    """The Rust virtiofsd podvm ships, as `make virtiofsd` fetches it
    (podvm_node/rust_virtiofsd.py): what every node serves the pods' files with."""
    require(RUST_VIRTIOFSD.is_file(), f"the Rust virtiofsd {RUST_VIRTIOFSD} (make virtiofsd)")
    return str(RUST_VIRTIOFSD)


def virtiofs_daemon(kind: str) -> str:
    """"rust" (rust_virtiofsd) or "qemu-7.2", Debian 12's own (vm_config allows it)."""
    if kind == "rust":
        return rust_virtiofsd()
    require(os.path.isfile(QEMU_VIRTIOFSD), f"{QEMU_VIRTIOFSD} (Debian package "
                                            f"qemu-system-common)")
    return QEMU_VIRTIOFSD


def vm_config(**qemu: object) -> Config:
    kernel, initrd = guest_image()
    fields = dict(kernel=kernel, initrd=initrd, image=root_image(), accel="tcg",
                  default_vcpus=1,
                  default_memory=256, default_maxvcpus=2, default_maxmemory=1024,
                  boot_timeout=60, template_path=str(TEMPLATES),
                  template_cgroup=TEMPLATE_CGROUP,
                  # the suite's pods (one namespace) mint shapes at will; the bound on
                  # new shapes is tests/vm/test_template_ledger.py's
                  template_new_per_hour=1000, template_new_per_namespace_per_hour=1000)
    fields.update(qemu)
    # podvm's own Rust daemon, as on a node; the C one with the key it needs (shim/config.py)
    fields.setdefault("virtio_fs_daemon", rust_virtiofsd())
    if fields["virtio_fs_daemon"] == QEMU_VIRTIOFSD:
        fields.setdefault("allow_legacy_virtiofsd", True)
    # the scratch disks' blank file system beside the templates: this run's, not the node's
    fields.setdefault("scratch_path", f"{fields['template_path']}-scratch")
    return Config(qemu=HypervisorConfig(**fields), runtime=RuntimeConfig(), source="(tests)")


def write_test_config(path: pathlib.Path, runtime: dict | None = None,
                      **qemu: object) -> pathlib.Path:
    """The same configuration as a TOML file, for a shim started by containerd;
    `runtime`: keys of its [runtime] section."""
    q = vm_config(**qemu).qemu
    lines = ["[hypervisor.qemu]"]
    for key in ("kernel", "initrd", "image", "accel", "template_path", "shared_fs",
                "template_cgroup", "scratch_path", "virtio_fs_daemon"):
        lines.append(f'{key} = "{getattr(q, key)}"')
    lines.append(f"enable_template = {json.dumps(q.enable_template)}")
    lines.append(f"allow_legacy_virtiofsd = {json.dumps(q.allow_legacy_virtiofsd)}")
    lines.append(f"enable_annotations = {json.dumps(list(q.enable_annotations))}")
    for key in ("default_vcpus", "default_memory", "default_maxvcpus", "default_maxmemory",
                "boot_timeout", "template_max_count", "template_max_mib", "scratch_disk_mib",
                "scratch_reserve_mib", "template_new_per_hour",
                "template_new_per_namespace_per_hour"):
        lines.append(f"{key} = {getattr(q, key)}")
    lines.append("[runtime]")
    for key, value in (runtime or {}).items():
        lines.append(f"{key} = {json.dumps(value)}")
    path.write_text("\n".join(lines) + "\n")
    return path


def warm_templates(path: pathlib.Path, *shapes: str) -> list[str]:
    """What a node's installer does (`podvmctl templates warm`) for the configuration
    file `path`: the default shape's template (or `shapes'`, VCPUS:MIB[:NICS[:MTU]])
    made before the first pod, so that a bench's pods restore it and no template is made
    in the background while figures are taken. What warm said, one line a shape."""
    return warm(load(str(path)).qemu, *shapes)


def warm(q: HypervisorConfig, *shapes: str) -> list[str]:
    if not q.enable_template:
        return []
    wanted = [templatemaker.Shape.parse(s) for s in shapes] or [templatemaker.default_shape(q)]
    outcomes = asyncio.run(templatemaker.warm(q, wanted))
    if not all(o.ready for o in outcomes):
        raise RuntimeError(f"templates not warmed: {'; '.join(o.line for o in outcomes)}")
    return [o.line for o in outcomes]
