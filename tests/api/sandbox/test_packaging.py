"""The containerd 2.x snippet for the Sandbox API, next to the default one: both are
valid TOML, register podvm's runtime type under distinct names, and only the sandboxer
variant hands the sandbox to the shim."""
from __future__ import annotations

import pathlib
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[3]
CRI = "io.containerd.cri.v1.runtime"


def runtimes(name: str) -> dict:
    text = (ROOT / "packaging" / "containerd" / name).read_text()
    return tomllib.loads(text)["plugins"][CRI]["containerd"]["runtimes"]


def test_the_sandboxer_variant_sits_next_to_the_default() -> None:
    default, sandboxer = runtimes("config-v3.toml"), runtimes("config-v3-sandboxer.toml")
    assert not set(default) & set(sandboxer)  # both can be installed together
    (name, runtime), = sandboxer.items()
    assert runtime["runtime_type"] == default["podvm"]["runtime_type"] == \
        "io.containerd.podvm.v2"
    assert runtime["sandboxer"] == "shim"
    assert default["podvm"].get("sandboxer", "podsandbox") == "podsandbox"
    assert runtime["options"]["ConfigPath"] == default["podvm"]["options"]["ConfigPath"]
    install = (ROOT / "docs" / "install.md").read_text()
    assert "config-v3-sandboxer.toml" in install and 'sandboxer = "shim"' in install
