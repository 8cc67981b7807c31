"""The guest kernel's own word on which sysctls a pod may set in its namespaces
(shim/pod/sysctls.py): the net.* files a new network namespace lacks are exactly the
ones podvm counts as VM-wide, and every ipc and uts name it counts as namespaced is
set in a new namespace without changing the guest's."""
from __future__ import annotations

import pytest

from shim.pod import sysctls
from tests.guestprobe import run_probe

SCRIPT = r"""
cd /proc/sys
find net -type f | sort > /init.txt
unshare -n sh -c 'find net -type f | sort' > /ns.txt
diff /init.txt /ns.txt | sed -n 's,^-net/,VM-WIDE net/,p'
for f in $(find kernel fs/mqueue -type f -maxdepth 1 | sort); do echo "FILE $f"; done
before=$(cat kernel/shm_rmid_forced)
unshare -i -u sh -c 'echo 1 > kernel/shm_rmid_forced; echo 77 > fs/mqueue/msg_max;
    echo pod.example > kernel/domainname;
    echo "INNER $(cat kernel/shm_rmid_forced) $(cat fs/mqueue/msg_max) $(cat kernel/domainname)"'
echo "OUTER $(cat kernel/shm_rmid_forced) $(cat fs/mqueue/msg_max) $(cat kernel/domainname)"
"""


@pytest.fixture(scope="module")
def console(tmp_path_factory) -> list[str]:
    return run_probe(tmp_path_factory.mktemp("sysctl-probe"), SCRIPT).splitlines()


def said(console: list[str], tag: str) -> list[str]:
    return [line.split(" ", 1)[1].strip() for line in console if line.startswith(tag + " ")]


def test_the_vm_wide_net_sysctls_are_those_a_new_network_namespace_lacks(console) -> None:
    measured = {path.replace("/", ".") for path in said(console, "VM-WIDE")}
    assert measured, "\n".join(console[-40:])
    listed = {name for name in measured if sysctls.namespace_of(name) is None}
    assert listed == measured, f"counted as the pod's: {sorted(measured - listed)}"
    assert sysctls._VM_WIDE_NET <= measured, sorted(sysctls._VM_WIDE_NET - measured)


def test_ipc_and_uts_sysctls_are_the_namespace_s_own(console) -> None:
    files = {path.replace("/", ".") for path in said(console, "FILE")}
    namespaced = {f for f in files if sysctls.namespace_of(f) in ("ipc", "uts")}
    assert {"kernel.shm_rmid_forced", "kernel.sem", "kernel.msgmax", "fs.mqueue.msg_max",
            "kernel.domainname"} <= namespaced, sorted(namespaced)
    assert said(console, "INNER") == ["1 77 pod.example"]
    assert said(console, "OUTER") == ["0 10 (none)"]
