"""`podvmctl config`: the effective configuration printed as a configuration file
(podvmctl/tomlwrite.py, the writer podvm-node's containerd drop-in uses too), which loads
back as the same configuration, arrays and all."""
from __future__ import annotations

from podvmctl import cli
from shim import config


def test_the_printed_configuration_loads_back_as_itself(tmp_path, capsys) -> None:
    conf = tmp_path / "podvm.toml"
    conf.write_text('[hypervisor.qemu]\naccel = "tcg"\n'
                    'enable_annotations = ["default_vcpus", "default_memory"]\n'
                    'default_maxvcpus = 2\n\n[runtime]\nsandbox_cgroup_only = false\n')
    assert cli.main(["config", "--file", str(conf)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"# effective podvm configuration, from {conf}\n")
    again = tmp_path / "again.toml"
    again.write_text(printed)
    want, got = config.load(str(conf)), config.load(str(again))
    assert got.qemu == want.qemu and got.runtime == want.runtime
    assert want.qemu.enable_annotations == ("default_vcpus", "default_memory")
