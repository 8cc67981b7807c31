"""A signal to a container's processes without running runc, which under TCG (and on a
busy node) costs the guest a Go process's start for each kill (and each removal): its init signalled by pid
(PID 1 reaps it, so the pid is the init's until its exit is known, as runc's state
says no more), and SIGKILL to all of its processes through its cgroup's `cgroup.kill`
(cgroup v2, one write: what `runc kill --all` does there). Other signals to all its
processes still go through `runc kill --all`, which signals each of them."""
from __future__ import annotations

import asyncio
import os
import signal
import time

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


async def remove_exited(container_id: str, wait: float = 2.0) -> bool:
    """What `runc delete` does for a container whose init has exited, without runc: its
    leftover processes killed (cgroup.kill), its cgroup removed once empty, runc's state
    of it deleted (the guest spec has no hooks: guest/agent/oci.py). False, with nothing
    but the kill done, where that cannot be (a cgroup with cgroups of its own, one that
    does not empty in `wait` seconds): runc then deletes it."""
    cgroup = f"{CGROUP_ROOT}{oci.CGROUP_PARENT}/{container_id}"
    kill_cgroup(container_id)
    deadline = time.monotonic() + wait
    while True:
        try:
            os.rmdir(cgroup)
            break
        except FileNotFoundError:
            break
        except OSError:
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.01)  # its processes are still exiting
    import shutil  # only when a container goes: the agent boots without it

    shutil.rmtree(os.path.join(runc.ROOT, container_id), ignore_errors=True)
    return True
