from __future__ import annotations

import dataclasses
import pathlib

import pytest

from shim import config

PACKAGED = pathlib.Path(__file__).parents[1] / "packaging" / "configuration.toml"


def test_packaged_file_states_exactly_the_defaults() -> None:
    loaded = config.load(str(PACKAGED))
    assert dataclasses.replace(loaded, source="") == dataclasses.replace(config.Config(),
                                                                         source="")


def test_partial_file_keeps_other_defaults(tmp_path: pathlib.Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('[hypervisor.qemu]\naccel = "tcg"\ndefault_vcpus = 2\n'
                 'enable_annotations = ["default_vcpus"]\n[runtime]\nenable_vcpus_pinning = true\n')
    c = config.load(str(f))
    assert (c.qemu.accel, c.qemu.default_vcpus, c.qemu.default_memory) == ("tcg", 2, 256)
    assert c.qemu.enable_annotations == ("default_vcpus",)
    assert c.runtime.enable_vcpus_pinning and c.runtime.sandbox_cgroup_only
    assert c.source == str(f)


@pytest.mark.parametrize("text, message", [
    ("[hypervisor.qemu]\ndefault_vcpu = 2\n", "unknown key 'default_vcpu' in [hypervisor.qemu]"),
    ("[hypervisor.qemu]\ndefault_vcpus = \"two\"\n", "default_vcpus must be an integer"),
    ("[hypervisor.qemu]\ndefault_vcpus = 0\n", "default_vcpus must be at least 1"),
    ("[hypervisor.qemu]\naccel = \"hvf\"\n", "accel must be one of kvm, tcg"),
    ("[hypervisor.qemu]\ndefault_memory = 32\n", "default_memory is in MiB"),
    ("[hypervisor.qemu]\ndefault_maxvcpus = 1\ndefault_vcpus = 2\n", "default_maxvcpus"),
    ("[hypervisor.clh]\npath = \"x\"\n", "unknown section [hypervisor.clh]"),
    ("[agent]\nx = 1\n", "unknown section [agent]"),
    ("[runtime]\nsandbox_cgroup_only = \"yes\"\n", "sandbox_cgroup_only must be true or false"),
    ("[runtime]\nsizing = \"min\"\n", "sizing must be one of sum, max"),
    ("[runtime]\ncpu_reservation = \"dedicated\"\n",
     "cpu_reservation must be one of shares, exclusive"),
    ("[runtime]\nreserved_cpus = \"0-x\"\n", "reserved_cpus"),
    ("[hypervisor.qemu]\nmemory_overhead = -1\n", "memory_overhead is in MiB"),
    ("[hypervisor.qemu]\nseccompsandbox = \"off\"\n", "seccompsandbox must be \"\" (off)"),
    ("[hypervisor.qemu]\ntemplate_cgroup = \"podvm\"\n", "template_cgroup must be an absolute"),
    ("[hypervisor.qemu]\ntemplate_cgroup = \"/a/../kubepods\"\n", "without '..'"),
    ("[hypervisor.qemu]\ntemplate_cgroup = \"/\"\n", "below the root"),
    ("[hypervisor.qemu]\nscratch_disk_mib = 10\n", "scratch_disk_mib must be 0"),
    ("[hypervisor.qemu]\nscratch_path = \"scratch\"\n", "scratch_path must be an absolute"),
    ("[runtime\n", "not valid TOML"),
    ("runtime = 3\n", "[runtime] must be a table"),
])
def test_bad_files_name_the_key_and_the_file(tmp_path, text, message) -> None:
    f = tmp_path / "bad.toml"
    f.write_text(text)
    with pytest.raises(config.ConfigError) as err:
        config.load(str(f))
    assert message in str(err.value) and str(f) in str(err.value)


def test_lookup_order(tmp_path, monkeypatch) -> None:
    env_file = tmp_path / "env.toml"
    env_file.write_text("[hypervisor.qemu]\ndefault_vcpus = 3\n")
    opt_file = tmp_path / "opt.toml"
    opt_file.write_text("[hypervisor.qemu]\ndefault_vcpus = 4\n")
    monkeypatch.setattr(config, "DEFAULT_PATH", str(tmp_path / "absent.toml"))
    monkeypatch.delenv(config.ENV_PATH, raising=False)
    assert config.load().source == "(built-in defaults)"
    monkeypatch.setenv(config.ENV_PATH, str(env_file))
    assert config.load().qemu.default_vcpus == 3
    assert config.load(str(opt_file)).qemu.default_vcpus == 4
    monkeypatch.setenv(config.ENV_PATH, str(tmp_path / "missing.toml"))
    with pytest.raises(config.ConfigError, match="not found"):
        config.load()


def test_the_default_virtiofsd_is_podvm_s_rust_one_never_the_c_one(monkeypatch) -> None:
    """podvm's own first (make install, podvm-node), the distribution's Rust one next;
    QEMU 7.2's C daemon, though installed, is never picked: a missing default is named."""
    installed = set()
    monkeypatch.setattr(config.os.path, "isfile", lambda p: p in installed)
    own, distribution = config.VIRTIO_FS_DAEMONS
    assert own == "/opt/podvm/libexec/virtiofsd"
    installed.update(config.LEGACY_VIRTIO_FS_DAEMONS)
    assert config.default_virtio_fs_daemon() == own
    installed.add(distribution)
    assert config.default_virtio_fs_daemon() == distribution
    installed.add(own)
    assert config.default_virtio_fs_daemon() == own


def test_the_c_virtiofsd_needs_its_key(tmp_path) -> None:
    """Named by its path or through a link, QEMU 7.2's daemon is refused with the key that
    allows it; with the key, or over 9p (no daemon runs), the file loads."""
    link = tmp_path / "virtiofsd"
    link.symlink_to(config.LEGACY_VIRTIO_FS_DAEMONS[0])
    for path in (config.LEGACY_VIRTIO_FS_DAEMONS[0], str(link)):
        f = tmp_path / "c.toml"
        f.write_text(f'[hypervisor.qemu]\nvirtio_fs_daemon = "{path}"\n')
        with pytest.raises(config.ConfigError, match="allow_legacy_virtiofsd = true") as err:
            config.load(str(f))
        assert str(f) in str(err.value) and f"virtio_fs_daemon {path} is QEMU 7.2's" in \
            str(err.value)
        f.write_text(f'[hypervisor.qemu]\nvirtio_fs_daemon = "{path}"\n'
                     f'allow_legacy_virtiofsd = true\n')
        assert config.load(str(f)).qemu.allow_legacy_virtiofsd
        f.write_text(f'[hypervisor.qemu]\nvirtio_fs_daemon = "{path}"\n'
                     f'shared_fs = "virtio-9p"\n')
        assert config.load(str(f)).qemu.virtio_fs_daemon == path
