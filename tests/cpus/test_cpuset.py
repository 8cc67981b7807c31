"""Host CPU sets: the pod's cpuset from its containers', the host's CPUs and cores."""
from __future__ import annotations

import pytest

from podvm_core.cpulist import CpuListError
from shim.cpus.cpuset import core_siblings, online_cpus, union


def test_union_of_the_containers_cpusets() -> None:
    assert union(["1", "3-4", "4,6"]) == {1, 3, 4, 6}
    # The sandbox container has no cpuset: it must not lift the others' restriction.
    assert union(["", "2"]) == {2}
    assert union(["", ""]) == frozenset()  # nobody has one: no restriction
    assert union([]) == frozenset()
    with pytest.raises(CpuListError, match="cpuset '1-x'"):
        union(["1-x"])


def test_online_cpus_and_siblings_from_sysfs(tmp_path) -> None:
    (tmp_path / "online").write_text("0-3\n")
    for cpu, siblings in ((0, "0,2"), (1, "1,3"), (2, "0,2")):
        topology = tmp_path / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "thread_siblings_list").write_text(siblings + "\n")
    assert online_cpus(str(tmp_path)) == {0, 1, 2, 3}
    assert core_siblings([0, 1, 2, 3], str(tmp_path)) == {
        0: {0, 2}, 1: {1, 3}, 2: {0, 2}, 3: {3}}  # cpu3 says nothing: a core of its own


def test_this_host() -> None:
    cpus = online_cpus()
    assert cpus and all(cpu in core_siblings(cpus)[cpu] for cpu in cpus)
