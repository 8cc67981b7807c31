"""Mount propagation from the host is refused by name, before anything is made; private
mounts (what containerd writes for mountPropagation None) pass."""
from __future__ import annotations

import pytest

from podvm_core.ttrpc import Code
from shim.api import errors
from shim.pod.errors import Refused
from shim.pod.hostns import refuse_host_propagation


def spec(*options: list[str], rootfs: str = "") -> dict:
    mounts = [{"destination": f"/m{i}", "type": "bind", "source": f"/src{i}",
               "options": list(opts)} for i, opts in enumerate(options)]
    return {"mounts": mounts, "linux": {"rootfsPropagation": rootfs} if rootfs else {}}


@pytest.mark.parametrize("options", [["rbind", "rprivate", "rw"], ["rbind", "ro"], []])
def test_private_mounts_pass(options: list[str]) -> None:
    refuse_host_propagation("c1", spec(options))


@pytest.mark.parametrize("option,field", [("rslave", "HostToContainer"),
                                          ("rshared", "Bidirectional"),
                                          ("slave", "HostToContainer")])
def test_propagation_from_the_host_is_refused_naming_the_mount(option, field) -> None:
    with pytest.raises(Refused) as refused:
        refuse_host_propagation("c1", spec(["rbind", "rw"], ["rbind", option, "rw"]))
    assert errors.code_of(refused.value) == Code.INVALID_ARGUMENT
    message = errors.to_ttrpc(refused.value).message
    assert "container c1" in message and f"/m1 ({option}: mountPropagation {field})" in message
    assert "/m0" not in message and "VM" in message


def test_rootfs_propagation_alone_is_refused() -> None:
    with pytest.raises(Refused, match=r"rootfsPropagation\) \(rshared"):
        refuse_host_propagation("c1", spec(["rbind"], rootfs="rshared"))
    refuse_host_propagation("c1", spec(["rbind"], rootfs="rprivate"))
