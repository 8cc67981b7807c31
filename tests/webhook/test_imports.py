"""The webhook's HTTP library stays in the webhook's process: the shim (start, the daemon,
a pod's planning) never loads aiohttp or the webhook, and `podvmctl plan` shares the
policy without the server. Checked in fresh interpreters."""
from __future__ import annotations

import json
import subprocess
import sys

from .harness import ROOT

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
    shim = loaded("shim.cli", "shim.manager", "shim.daemon", "shim.pod.pod", "shim.ctl")
    assert "shim.pod.pod" in shim  # the probe does load what it names
    assert not {m for m in shim if m.split(".")[0] in ("aiohttp", "yaml")
                or m.startswith("shim.webhook")}


def test_plan_shares_the_policy_without_the_server() -> None:
    plan = loaded("shim.plan")
    assert "shim.webhook.policy" in plan
    assert not {m for m in plan if m.split(".")[0] == "aiohttp" or m == "shim.webhook.server"}
    assert "aiohttp" in loaded("shim.webhook.cli")
