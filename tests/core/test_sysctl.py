"""Sysctl names, either form, and the /proc/sys file each one sets."""
from __future__ import annotations

import pytest

from podvm_core.sysctl import dotted, proc_path


@pytest.mark.parametrize("name, expected", [
    ("kernel.shm_rmid_forced", "kernel.shm_rmid_forced"),
    ("net.ipv4.conf.eth0/100.forwarding", "net.ipv4.conf.eth0/100.forwarding"),
    ("net/ipv4/conf/eth0.100/forwarding", "net.ipv4.conf.eth0/100.forwarding"),
    ("net/ipv4/ip_forward", "net.ipv4.ip_forward"),
])
def test_the_slash_form_becomes_the_dotted_one(name: str, expected: str) -> None:
    assert dotted(name) == expected


def test_a_dotted_name_sets_its_file_a_vlan_part_keeps_its_dot() -> None:
    assert proc_path("fs.mqueue.msg_max") == "/proc/sys/fs/mqueue/msg_max"
    assert proc_path("net.ipv4.conf.eth0/100.forwarding") == \
        "/proc/sys/net/ipv4/conf/eth0.100/forwarding"
    assert proc_path("net/ipv4/conf/eth0.100/forwarding") == \
        "/proc/sys/net/ipv4/conf/eth0.100/forwarding"


@pytest.mark.parametrize("name", ["", "kernel..sem", "net.ipv4.//.x", "net/../kernel/x",
                                  "kernel.sem ", "a=b", "kernel.\0x", ".kernel.sem"])
def test_a_name_that_would_leave_its_place_is_refused(name: str) -> None:
    with pytest.raises(ValueError, match="sysctl name"):
        proc_path(name)
