"""`containerd-shim-podvm-v2 -info`: the RuntimeInfo containerd 2.x reads from a runtime's
stdout before it relies on a feature. Its `features` is the OCI runtime-spec features
document of what podvm honours in the guest: containerd's CRI passes a mount's
`recursive_read_only` on only to a runtime whose mountOptions list `rro`."""
from __future__ import annotations

import json

from .. import __version__

FEATURES_TYPE_URL = "types.containerd.io/opencontainers/runtime-spec/1/features/Features"

# runc's own list (the guest runs runc), less mount propagation: the host's mounts
# cannot reach a VM, so shared/slave mounts are refused (shim/pod/hostns.py).
MOUNT_OPTIONS = sorted({
    "acl", "async", "atime", "bind", "defaults", "dev", "diratime", "dirsync", "exec",
    "iversion", "lazytime", "loud", "mand", "noacl", "noatime", "nodev", "nodiratime",
    "noexec", "noiversion", "nolazytime", "nomand", "norelatime", "nostrictatime",
    "nosuid", "nosymfollow", "private", "ratime", "rbind", "rdev", "rdiratime",
    "relatime", "remount", "rexec", "rnoatime", "rnodev", "rnodiratime", "rnoexec",
    "rnorelatime", "rnostrictatime", "rnosuid", "rnosymfollow", "ro", "rprivate",
    "rrelatime", "rro", "rrw", "rstrictatime", "rsuid", "rsymfollow", "runbindable", "rw",
    "silent", "strictatime", "suid", "symfollow", "sync", "tmpcopyup", "unbindable"})


def features() -> dict:
    return {
        "ociVersionMin": "1.0.0",
        "ociVersionMax": "1.0.2",
        # OCI hooks would run on the host against a process in the guest: left out.
        "hooks": [],
        "mountOptions": MOUNT_OPTIONS,
        "linux": {
            # no user namespaces (nor idmapped mounts): containerd then keeps CRI userns off
            "namespaces": ["cgroup", "ipc", "mount", "network", "pid", "uts"],
            "cgroup": {"v1": True, "v2": True},
            "seccomp": {"enabled": True},
        },
        "annotations": {"io.podvm.vm": "true"},
    }


def runtime_info() -> bytes:
    from podvm_core.pb.containerd.types import introspection_pb2 as pb  # `-info` only

    info = pb.RuntimeInfo(name="io.containerd.podvm.v2",
                          version=pb.RuntimeVersion(version=__version__))
    info.features.type_url = FEATURES_TYPE_URL
    info.features.value = json.dumps(features()).encode()
    return info.SerializeToString()
