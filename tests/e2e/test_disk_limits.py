"""Each container's ephemeral-storage limit and each disk emptyDir's sizeLimit, enforced in
the guest through the real CRI (issue 44): the pod's annotation (podvm-webhook's, written
here by hand) reaches each container's spec through containerd's pod_annotations, and the
guest makes each writable layer and emptyDir an ext4 project of its own
(guest/agent/quota.py). One pod boot."""
from __future__ import annotations

import json
import re

from testbed.cri import write_config
from testbed.kubeletdirs import kubelet_root, volume_dir  # noqa: F401
from testbed.pods import container_config, pod_config

from .test_podvm_pods import configs, crictl, remove_pod  # noqa: F401

MIB = 1 << 20
LIMITS = {"containers": {"bounded": 100 * MIB}, "emptyDirs": {"cache": 50 * MIB},
          "unbounded": ["container:free"]}


def written(crictl, cid: str, path: str, mib: int) -> tuple[int, str, int]:  # noqa: F811
    """(dd's exit code, what it said, the file's size) after writing `mib` MiB to `path`."""
    got = crictl.exec(cid, "sh", "-c", f"dd if=/dev/zero of={path} bs=1M count={mib} "
                      f"conv=fsync 2>&1; echo exit=$?; stat -c size=%s {path}", timeout=300)
    code = int(re.search(r"exit=(\d+)", got.stdout).group(1))
    size = int(re.search(r"size=(\d+)", got.stdout).group(1))
    return code, got.stdout, size


def test_a_container_and_an_empty_dir_meet_their_own_limits(
        ctd, crictl, configs, kubelet_root) -> None:  # noqa: F811
    """A container with a 100Mi limit writing 150Mi is stopped at about 100Mi with EDQUOT,
    and sees its limit as its root's size; the pod's other container still writes its
    root and the emptyDir, which stops it at its own 50Mi; the space the bounded container
    frees is its again."""
    cache = volume_dir(kubelet_root, "cache")
    pod_file = write_config(configs, "pod-limits.json", pod_config(
        ctd, configs, "limits", annotations={"storage.podvm.io/limits": json.dumps(LIMITS)}))
    pod_id = crictl.runp(pod_file, runtime="podvm")
    try:
        ids = {}
        for name in ("bounded", "free"):
            config = dict(container_config(name, "exec sleep 1000"),
                          mounts=[{"container_path": "/cache", "host_path": str(cache)}])
            ids[name] = crictl.create(pod_id, write_config(configs, f"{name}.json", config),
                                      pod_file)
            crictl.start(ids[name])

        code, said, size = written(crictl, ids["bounded"], "/fill", 150)
        assert code != 0 and "Disk quota exceeded" in said, said
        assert 95 * MIB <= size <= 100 * MIB, said
        df = crictl.exec(ids["bounded"], "df", "-k", "/").stdout.split("\n")[1].split()
        assert 99 * 1024 <= int(df[1]) <= 100 * 1024, df  # its limit is its root's size

        code, said, size = written(crictl, ids["free"], "/more", 120)
        assert code == 0 and size == 120 * MIB, said
        code, said, size = written(crictl, ids["free"], "/cache/big", 80)
        assert code != 0 and "Disk quota exceeded" in said, said
        assert 45 * MIB <= size <= 50 * MIB, said

        code, said, size = written(crictl, ids["bounded"], "/fill", 60)
        assert code == 0 and size == 60 * MIB, said
    finally:
        remove_pod(crictl, pod_id)
