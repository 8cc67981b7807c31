from __future__ import annotations

import pytest

from testbed.webhook import Webhook

STATIC_CONFIG = """\
[hypervisor.qemu]
default_vcpus = 1
default_memory = 256
default_maxmemory = 2048
enable_annotations = ["default_vcpus", "default_memory"]
[runtime]
static_sandbox_resource_mgmt = true
"""
DYNAMIC_CONFIG = """\
[hypervisor.qemu]
default_maxmemory = 2048
enable_annotations = ["default_vcpus", "default_memory"]
"""


def _served(tmp_path_factory, name: str, config: str):
    webhook = Webhook(tmp_path_factory.mktemp(name), config).start()
    try:
        yield webhook
    finally:
        status = webhook.stop()
        assert status == 0, f"podvm-webhook exited {status}: {webhook.log_text()}"


@pytest.fixture(scope="module")
def static_webhook(tmp_path_factory):
    yield from _served(tmp_path_factory, "webhook-static", STATIC_CONFIG)


@pytest.fixture(scope="module")
def dynamic_webhook(tmp_path_factory):
    yield from _served(tmp_path_factory, "webhook-dynamic", DYNAMIC_CONFIG)


@pytest.fixture
def webhook(tmp_path):
    """A server of its own (for tests that change its certificate)."""
    served = Webhook(tmp_path, STATIC_CONFIG).start()
    try:
        yield served
    finally:
        assert served.stop() == 0, served.log_text()
