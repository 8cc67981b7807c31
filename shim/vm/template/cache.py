"""The templates' memory kept in the host's page cache, so that a restore copies it from
RAM rather than from the disk (the copy is a restore's longest step, and its reads from
disk the longest part of it). What the node keeps there is charged to a cgroup of its
own beside the template makers' (`<template_cgroup>/podvm_templates-cache`): the node's
reserve pays for it, never a pod, and its memory limit is the store's bound on disk
(template_max_mib), so it holds at most every template once. Its pages are clean page
cache: the host reclaims them under memory pressure like any other, and a template whose
pages went is read from disk again, past the page cache (shim/vm/memcopy.py), until it
is warmed again.

A template is warmed by a process placed in that cgroup, which reads its memory's data
and checks each chunk against its digest (memcopy.py --warm: a pod's copy takes what is
in the page cache as checked, while the file is unchanged): after it is made
(shim/vm/template/maker.py), and after a pod restored it from disk
(shim/vm/template/restore.py), off every pod's path. A pod's copier
reads a warm template from the page cache without being charged for it: a page is
charged to the cgroup that brought it in, not to the ones that read it later."""
from __future__ import annotations

import asyncio
import logging
import sys
from typing import Sequence

import cgroups
from cgroups import CgroupLimits, SandboxCgroup, SandboxLayout

from ...config import HypervisorConfig
from .. import memcopy, stateload

log = logging.getLogger("podvm.templatecache")

CPU_SHARES = 128
"""The CPU weight under cgroup v1 of the cgroups templates are made and warmed in (a pod's
is 1024 per CPU): pods go first."""
NAME = "templates-cache"


def layout(q: HypervisorConfig) -> SandboxLayout:
    """The cache's cgroup, below template_cgroup in each hierarchy."""
    return SandboxLayout(q.template_cgroup, NAME)


async def warm(q: HypervisorConfig, memory: str, digests: Sequence[str]) -> bool:
    """The template memory file `memory` in the page cache, charged to the cache's cgroup
    (made where it is not), each chunk read into it checked against its `digests` (a
    restore takes what is there as checked: memcopy.copy); True when it is there. What
    goes wrong is logged, not raised: a template that is not warm is read from disk, and
    one that changed is left out of the page cache, for the restore to refuse."""
    if await asyncio.to_thread(stateload.resident, memory):
        return True
    warmer = None
    try:
        manager = cgroups.detect()
        cgroup = SandboxCgroup.create(
            layout(q), CgroupLimits(cpu_shares=CPU_SHARES if manager.version == 1 else None,
                                    memory_limit_bytes=q.template_max_mib << 20), manager)
        warmer = await asyncio.create_subprocess_exec(
            sys.executable, "-I", "-S", memcopy.__file__, "--warm", memory,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE, preexec_fn=cgroup.preexec())
        _, said = await warmer.communicate(",".join(digests).encode())
    except (OSError, cgroups.CgroupError) as exc:
        log.warning("template memory %s not kept in the page cache: %s", memory, exc)
        return False
    finally:
        if warmer is not None and warmer.returncode is None:  # cancelled: the pod went
            warmer.kill()
            await warmer.wait()
    if warmer.returncode:
        log.warning("template memory %s not kept in the page cache: %s", memory,
                    said.decode(errors="replace").strip() or warmer.returncode)
        return False
    return True
