"""A signal to a container's processes without running runc, which under TCG (and on a
busy node) costs the guest a Go process's start for each kill: its init signalled by pid
(PID 1 reaps it, so the pid is the init's until its exit is known, as runc's state
says no more), and SIGKILL to all of its processes through its cgroup's `cgroup.kill`
(cgroup v2, one write: what `runc kill --all` does there). Other signals to all its
processes still go through `runc kill --all`, which signals each of them."""
from __future__ import annotations

import os
import signal

from . import oci, runc

CGROUP_ROOT = "/sys/fs/cgroup"


async def signal_container(container_id: str, init_pid: int, signum: int,
                           every: bool) -> None:
    """ProcessLookupError: the init has exited; runc's TtrpcError for what runc refuses."""
    if not every:
        os.kill(init_pid, signum)
    elif signum != signal.SIGKILL or not kill_cgroup(container_id):
        await runc.runc(container_id, "kill", "--all", container_id, str(signum))


def kill_cgroup(container_id: str) -> bool:
    """Every process of the container's cgroup SIGKILLed at once; False where the cgroup
    cannot be written (gone, or no cgroup.kill): runc then does it."""
    path = f"{CGROUP_ROOT}{oci.CGROUP_PARENT}/{container_id}/cgroup.kill"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        os.write(fd, b"1")
    except OSError:
        return False
    finally:
        os.close(fd)
    return True
