from __future__ import annotations

import pathlib

import pytest

from testbed import bridgenet
from testbed.containerd import Containerd
from testbed.prereqs import require, require_root, require_tool
from testbed.vmconfig import vm_config, warm

from .test_podvm_pods import cri_containerd


@pytest.fixture(scope="module")
def containerd(tmp_path_factory):
    require_root()
    require_tool("containerd", "containerd")
    require_tool("ctr", "containerd")
    require_tool("busybox", "busybox-static")
    c = Containerd(tmp_path_factory.mktemp("containerd")).start()
    yield c
    c.stop()


@pytest.fixture(scope="session")
def pod_network() -> None:
    """What a module whose pods must be on the test bridge (testbed/bridgenet.py) and run
    busybox's servers needs: a CRI containerd on a machine without it runs its pods on no
    network, so its tests would fail later and less clearly."""
    require_tool("busybox", "busybox-static")
    missing = bridgenet.missing_prerequisites()
    require(not missing, ", ".join(missing))


@pytest.fixture(scope="session")
def image_cache(tmp_path_factory) -> pathlib.Path:
    """The CRI modules' images; first, the run's default-shape templates warmed, as the
    node installer does (testbed/vmconfig.py: the run's template store), on a pod network
    and, for the Task API's pods, on none: their pods are restored, as on a node."""
    warm(vm_config().qemu, "1:256:1", "1:256:0")
    return tmp_path_factory.mktemp("images")


@pytest.fixture(scope="module")
def ctd(tmp_path_factory, image_cache):
    """A module's CRI containerd whose pods restore the run's warmed templates, as on a
    node. test_podvm_pods has a `ctd` of its own, whose pods boot their guests (the boot
    path's end-to-end run): a module that imports it gets those cold boots instead."""
    yield from cri_containerd(tmp_path_factory, image_cache, "podvm-cri-restored",
                              "podvm-restored-test")
