"""bench/scale.py's smoke run (issue 30): five pods of three shapes started at once
through the CRI, then all removed at once. Asserts completeness, not speed: every pod
ready with its container running and charged to its sandbox cgroup, every pod removed,
nothing left of any. The figures are bench/scale.py's with 20 pods.

The default shape's template is made first (warm: the run's, tests/e2e/conftest.py), as a
node's installer has it made: the five restore it at once rather than boot five TCG
guests (most of a minute on two CPUs)."""
from __future__ import annotations

import pytest

from bench.scale import SHAPES, report, run_scale
from bench.pod_bench import sizes

from .test_podvm_pods import cri_containerd

PODS = 5


@pytest.fixture(scope="module")
def ctd(tmp_path_factory, image_cache):
    # boot_timeout: on a loaded machine five guests restored and grown at once are slow
    yield from cri_containerd(tmp_path_factory, image_cache, "podvm-scale", "podvm-scale-test",
                              enable_annotations=("default_vcpus", "default_memory"),
                              boot_timeout=300)


def test_pods_started_at_once_all_run_and_all_go(ctd, tmp_path) -> None:
    run = run_scale(ctd, tmp_path, PODS, sizes(SHAPES))
    print(report(run))
    assert [p.error for p in run.pods] == [""] * PODS, report(run)
    assert len({p.pod_id for p in run.pods}) == PODS and all(p.container_id for p in run.pods)
    assert all(p.cgroups for p in run.pods), "a pod without its sandbox cgroup in its state"
    assert all(p.memory_bytes for p in run.pods), "a sandbox cgroup charged nothing"
    assert run.teardown_errors == [], report(run)
    assert run.left == [], report(run)
