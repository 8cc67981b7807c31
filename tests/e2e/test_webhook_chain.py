"""The chain from admission to the node: the real podvm-webhook admits a static-mode pod
and annotates it, and the pod, run through containerd's CRI on the podvm runtime with
those annotations and the resources kubelet derives from its spec, boots exactly the VM
the webhook computed. Real webhook (HTTPS), real containerd, real QEMU (TCG)."""
from __future__ import annotations

import json

import pytest

from shim import config
from podvmctl import status
from shim.resources.annotations import KATA
from testbed.containerd import CRI_NAMESPACE
from testbed.cri import Crictl, write_config
from testbed.pods import container_config, pod_config
from testbed.webhook import Webhook, apply_patch, container, decoded_patch, pod

from .test_pod_resources import guest_size, remove_pod, start_containerd

MIB = 1 << 20
GUEST_KERNEL_MIB = 64
"""What the guest kernel keeps of the VM's memory before MemTotal (its image, memmap):
at most 64 MiB up to 1 GiB VMs (tests/e2e/test_guest_memory.py)."""


@pytest.fixture(scope="module")
def node(tmp_path_factory, image_cache):
    """A static-mode node that lets pods carry the sizing annotations. Its pod boots
    three vCPUs under TCG (static: no template), which a busy core can hold past a
    minute."""
    workdir = tmp_path_factory.mktemp("webhook-chain")
    ctd = start_containerd(workdir, image_cache, {"static_sandbox_resource_mgmt": True},
                           default_maxvcpus=4, default_maxmemory=2048, boot_timeout=180,
                           enable_annotations=("default_vcpus", "default_memory"))
    try:
        yield ctd
    finally:
        ctd.stop()


@pytest.fixture(scope="module")
def webhook(node, tmp_path_factory):
    """The webhook, with the nodes' configuration file (as its ConfigMap would hold it)."""
    with open(node.podvm_config) as f:
        served = Webhook(tmp_path_factory.mktemp("webhook-chain-server"), f.read()).start()
    try:
        yield served
    finally:
        assert served.stop() == 0, served.log_text()


def test_the_vm_is_the_one_the_webhook_computed(node, webhook, tmp_path) -> None:
    cfg = config.load(node.podvm_config)
    overhead_mib = cfg.qemu.default_memory + cfg.qemu.vmm_overhead_mib  # as packaged
    manifest = pod(container("app", cpu="1500m", memory="320Mi"), name="chain",
                   overhead={"cpu": "1", "memory": f"{overhead_mib}Mi"})
    response = webhook.review("mutate", manifest).response
    assert response["allowed"] is True, response
    admitted = apply_patch(manifest, decoded_patch(response))
    annotations = admitted["metadata"]["annotations"]
    assert annotations[KATA + "default_vcpus"] == "1"
    assert annotations[KATA + "default_memory"] == "256"
    vm = json.loads(annotations["podvm.io/vm"])
    assert vm == {"vcpus": 3, "memoryMiB": 576}  # ceil(1 + 1.5); 256 + 320

    # What kubelet sends for this pod: its annotations, the pod's limits (1.5 CPUs as a
    # quota of 150 ms per 100 ms, shares from the 1.5 CPU request, 320 MiB), its overhead.
    crictl = Crictl(node.cri_endpoint, timeout="120s")
    sandbox = pod_config(node, tmp_path, "chain", annotations=annotations)
    sandbox["linux"]["resources"] = {"cpu_period": 100_000, "cpu_quota": 150_000,
                                     "cpu_shares": 1536, "memory_limit_in_bytes": 320 * MIB}
    sandbox["linux"]["overhead"] = {"cpu_period": 100_000, "cpu_quota": 100_000,
                                    "memory_limit_in_bytes": overhead_mib * MIB}
    pod_file = write_config(tmp_path, "chain-pod.json", sandbox)
    pod_id = crictl.runp(pod_file, runtime="podvm")
    try:
        app = container_config("app", "sleep 1000")
        app["linux"] = {"resources": {"cpu_period": 100_000, "cpu_quota": 150_000,
                                      "cpu_shares": 1536,
                                      "memory_limit_in_bytes": 320 * MIB}}
        cid = crictl.create(pod_id, write_config(tmp_path, "chain-app.json", app), pod_file)
        crictl.start(cid)
        report = status.collect(status.find(pod_id, CRI_NAMESPACE))
        assert (report["vm"]["qemu_vcpus"], report["vm"]["qemu_memory_mib"]) == \
            (vm["vcpus"], vm["memoryMiB"])
        assert (report["plan"]["vcpus"], report["plan"]["memory_mib"]) == \
            (vm["vcpus"], vm["memoryMiB"])
        assert report["plan"]["overhead_memory_mib"] == overhead_mib
        cpus, mem_total = guest_size(crictl, cid)
        assert cpus == vm["vcpus"]
        assert vm["memoryMiB"] - GUEST_KERNEL_MIB <= mem_total <= vm["memoryMiB"]
    finally:
        remove_pod(node, crictl, pod_id)
