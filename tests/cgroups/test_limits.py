"""Limit values are checked whole before anything is written, and translated the way
Kubernetes and runc translate them."""
from __future__ import annotations

import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cgroups import QEMU_DEVICES, CgroupLimits, DeviceRule, InvalidLimits, shares_to_weight
from cgroups.limits import format_cpu_list, parse_cpu_list


@pytest.mark.parametrize("shares,weight", [(2, 1), (1024, 39), (262144, 10000), (512, 20)])
def test_shares_become_weight_as_kubernetes_computes_it(shares, weight):
    assert shares_to_weight(shares) == weight


@given(st.integers(2, 262143))
def test_weight_is_monotonic_and_in_range(shares):
    assert 1 <= shares_to_weight(shares) <= shares_to_weight(shares + 1) <= 10000


@given(st.sets(st.integers(0, 300), min_size=1))
def test_cpu_lists_round_trip_in_the_kernels_canonical_form(cpus):
    text = format_cpu_list(cpus)
    assert parse_cpu_list(text) == cpus
    assert CgroupLimits(cpuset_cpus=text).cpuset_cpus == text


def test_cpu_lists_are_normalised():
    assert CgroupLimits(cpuset_cpus="3,0-1,2").cpuset_cpus == "0-3"


@pytest.mark.parametrize("kwargs", [
    {"cpu_quota_us": -1}, {"cpu_quota_us": 999}, {"cpu_period_us": 999},
    {"cpu_period_us": 1_000_001}, {"cpu_shares": 1}, {"cpu_shares": 262145},
    {"memory_limit_bytes": 0}, {"pids_limit": 0}, {"pids_limit": -5},
    {"cpuset_cpus": ""}, {"cpuset_cpus": "1-0"}, {"cpuset_cpus": "a"}, {"cpuset_cpus": "1,,2"},
    {"cpuset_mems": "0-"}, {"cpu_shares": 1.5}, {"memory_limit_bytes": True},
    {"devices": ("c 1:3 rwm",)},
])
def test_bad_values_are_refused_before_anything_is_written(kwargs):
    with pytest.raises(InvalidLimits) as err:
        CgroupLimits(**kwargs)
    assert next(iter(kwargs)) in str(err.value)


@pytest.mark.parametrize("rule", [("x", 1, 3), ("c", -1, 3), ("c", 1, 3, "rwx")])
def test_bad_device_rules_are_refused(rule):
    with pytest.raises(InvalidLimits):
        DeviceRule(*rule)


def test_controllers_needed_and_restriction():
    limits = CgroupLimits(cpu_quota_us=50000, memory_limit_bytes=1 << 30, pids_limit=10,
                          cpuset_cpus="0", devices=QEMU_DEVICES)
    assert limits.controllers() == {"cpu": ["cpu_quota_us"], "memory": ["memory_limit_bytes"],
                                    "pids": ["pids_limit"], "cpuset": ["cpuset_cpus"],
                                    "devices": ["devices"]}
    only = limits.restricted_to({"memory", "cpuset"})
    assert only == CgroupLimits(memory_limit_bytes=1 << 30, cpuset_cpus="0")


def test_qemu_device_numbers_match_the_nodes_this_host_has():
    """The allow-list is by number; a wrong number would deny QEMU a device it needs."""
    checked = 0
    for rule in QEMU_DEVICES:
        if "*" in rule.name or not os.path.exists(rule.name):
            continue
        st_rdev = os.stat(rule.name).st_rdev
        assert (os.major(st_rdev), os.minor(st_rdev)) == (rule.major, rule.minor), rule.name
        checked += 1
    assert checked >= 5  # /dev/null, zero, full, random, urandom exist everywhere
