"""Pinning and in-guest confinement rules, and their actuator on real threads."""
from __future__ import annotations

import os
import threading

from hypothesis import given
from hypothesis import strategies as st

from shim.cpus.pinning import (apply, guest_cpus, guest_cpus_for_update, pin_map,
                               vcpus_by_host_cpu)


def test_one_to_one_when_counts_match_else_float() -> None:
    assert pin_map([11, 12], 2, {4, 2}, enabled=True) == {11: {2}, 12: {4}}
    assert pin_map([11, 12], 2, {2, 4}, enabled=False) == {11: {2, 4}, 12: {2, 4}}
    assert pin_map([11, 12, 13], 3, {2, 4}, enabled=True) == {t: {2, 4} for t in (11, 12, 13)}
    # A third vCPU present but offline floats; the two online ones are pinned.
    assert pin_map([11, 12, 13], 2, {2, 4}, enabled=True) == {11: {2}, 12: {4}, 13: {2, 4}}
    assert pin_map([11], 1, set(), enabled=True) == {}


def test_no_cpuset_floats_over_the_whole_host() -> None:
    # A pinned mask outlives a wider cpuset: with the restriction gone it must be widened,
    # never left as it was, and never pinned 1:1 (nobody asked for these CPUs).
    assert pin_map([11, 12], 2, set(), enabled=True, everywhere={0, 1}) == {
        11: {0, 1}, 12: {0, 1}}
    assert pin_map([11], 1, iter([3]), enabled=True) == {11: {3}}


def test_guest_cpus_follow_the_pins() -> None:
    pins = [frozenset({2}), frozenset({3}), frozenset({5})]
    assert guest_cpus({3, 5}, pins) == [1, 2]
    assert guest_cpus({2}, pins) == [0]
    assert guest_cpus({7}, pins) == []  # no overlap: no confinement
    assert guest_cpus({2, 3}, [frozenset({2, 3})] * 2) == []  # floating: none


def test_an_update_lifts_a_confinement_explicitly() -> None:
    pins = [frozenset({2}), frozenset({3})]
    assert guest_cpus_for_update({3}, pins) == [1]
    # Floating now: runc update would keep the old cpuset if told nothing.
    assert guest_cpus_for_update({2}, [frozenset({2, 3})] * 3) == [0, 1, 2]


def test_host_cpus_map_to_the_vcpus_pinned_on_them() -> None:
    pins = [frozenset({2}), frozenset({3}), frozenset({2, 3}), frozenset()]
    assert vcpus_by_host_cpu(pins) == {2: [0], 3: [1]}


@given(tids=st.lists(st.integers(1, 10_000), min_size=1, max_size=8, unique=True),
       cpus=st.sets(st.integers(0, 63), min_size=1, max_size=8), enabled=st.booleans())
def test_properties(tids, cpus, enabled) -> None:
    online = min(len(tids), len(cpus))
    pins = pin_map(tids, online, cpus, enabled)
    assert set(pins) == set(tids)
    assert all(p and p <= cpus for p in pins.values())  # never outside the pod's set
    if enabled and online == len(cpus):  # 1:1: no two online vCPUs on one CPU
        pinned = [pins[t] for t in tids[:online]]
        assert all(len(p) == 1 for p in pinned) and len(set(pinned)) == online
    else:  # floating over the whole set
        assert all(p == cpus for p in pins.values())
    disjoint = [frozenset({c}) for c in sorted(cpus)]
    a, b = set(sorted(cpus)[::2]), set(sorted(cpus)[1::2])
    assert not set(guest_cpus(a, disjoint)) & set(guest_cpus(b, disjoint))


def test_apply_sets_real_thread_affinity() -> None:
    allowed = sorted(os.sched_getaffinity(0))
    ready, done = threading.Event(), threading.Event()
    tids: list[int] = []

    def worker() -> None:
        tids.append(threading.get_native_id())
        ready.set()
        done.wait(10)

    t = threading.Thread(target=worker)
    t.start()
    ready.wait(5)
    try:
        seen = apply({tids[0]: frozenset({allowed[-1]}), 999_999_999: frozenset({0})})
        assert seen == {tids[0]: frozenset({allowed[-1]})}
        assert os.sched_getaffinity(tids[0]) == {allowed[-1]}
    finally:
        done.set()
        t.join()
