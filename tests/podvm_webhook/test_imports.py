"""The webhook's HTTP library stays in the webhook's process: the shim (start, the daemon,
a pod's planning) never loads aiohttp or the webhook, and `podvmctl plan` shares the
policy without the server. Checked in fresh interpreters."""
from __future__ import annotations

import json
import subprocess
import sys

from testbed.webhook import ROOT

_PROBE = """
import json, sys
for name in sys.argv[1:]:
    __import__(name)
print(json.dumps(sorted(sys.modules)))
"""


def loaded(*modules: str) -> set[str]:
    result = subprocess.run([sys.executable, "-c", _PROBE, *modules], cwd=ROOT,
                            capture_output=True, text=True, timeout=60, check=True)
    return set(json.loads(result.stdout))


def test_the_shim_never_loads_the_webhook() -> None:
    shim = loaded("shim.contract.cli", "shim.contract.manager", "shim.contract.daemon",
                  "shim.pod.pod", "podvmctl.cli")
    assert "shim.pod.pod" in shim  # the probe does load what it names
    assert not {m for m in shim if m.split(".")[0] in ("aiohttp", "yaml", "prometheus_client")
                or m.startswith(("podvm_webhook", "podvm_node"))}


def test_plan_shares_the_policy_without_the_server() -> None:
    plan = loaded("podvmctl.plan")
    assert "podvm_webhook.policy" in plan
    assert not {m for m in plan if m.split(".")[0] == "aiohttp" or m == "podvm_webhook.server"}
    assert not {m for m in plan if m.split(".")[0] == "prometheus_client"}
    assert {"aiohttp", "prometheus_client"} <= loaded("podvm_webhook.cli")
