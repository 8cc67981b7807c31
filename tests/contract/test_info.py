"""`-info` as containerd 2.x runs it: a RuntimeInfo on stdout whose features say what
podvm honours (rro, so the CRI passes recursive read-only mounts on; no propagation from
the host, no user namespaces)."""
from __future__ import annotations

import json
import subprocess

from podvm_core.pb.containerd.types import introspection_pb2 as pb
from shim import __version__
from shim.contract.flags import parse
from testbed.shimproc import SHIM


def test_the_binary_answers_info_with_its_features() -> None:
    # containerd writes the runtime options on stdin; the answer does not depend on them
    done = subprocess.run([SHIM, "-info"], input=b"\x0a\x00", capture_output=True,
                          timeout=30)
    assert done.returncode == 0, done.stderr
    info = pb.RuntimeInfo.FromString(done.stdout)
    assert info.name == "io.containerd.podvm.v2" and info.version.version == __version__
    assert info.features.type_url == \
        "types.containerd.io/opencontainers/runtime-spec/1/features/Features"
    features = json.loads(info.features.value)
    assert "rro" in features["mountOptions"] and "ro" in features["mountOptions"]
    assert not {"rshared", "shared", "rslave", "slave"} & set(features["mountOptions"])
    assert "user" not in features["linux"]["namespaces"]
    assert features["hooks"] == []


def test_info_is_a_flag_like_the_others() -> None:
    assert parse(["-info"]).info and not parse([]).info
    assert parse(["-info=false"]).info is False
