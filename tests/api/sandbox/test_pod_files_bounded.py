"""A root container of a "shim"-sandboxer pod writes its /etc/hosts, /etc/hostname and
/etc/resolv.conf as far as it can (`dd of=/etc/hosts`): they are podvm's files in the
pod's state directory, on the host's /run, a tmpfs on a node that containerd's, kubelet's
and every pod's sockets need. Nothing it writes may land there: the host's free space
under the state directory does not move by more than a small bound, nor the pod's
directory grow, and the files still say what podvm wrote. The namespace's directory in
/run/podvm is a tmpfs of the test's own, as /run is on a node: what lands there shows in
its free space alone, not drowned by what other programs write the machine's disk.

containerd 2.x's CRI is played by the harness over ttrpc against the real shim binary:
Debian's containerd 1.6 writes these files itself and never hands them to the shim."""
from __future__ import annotations

import contextlib
import os
import pathlib

from podvm_core.pb.containerd.runtime.sandbox.v1 import sandbox_pb2 as sb
from shim.host import mounts, paths
from tests.contract.test_process_contract import wait_gone

from tests.api.sandbox.harness import MIB, NS, sandbox_shim
from tests.api.sandbox.test_podfiles import rootfs, run_container  # noqa: F401

FILES = ("/etc/hosts", "/etc/hostname", "/etc/resolv.conf")
WRITE_MIB = 64
"""Each file written up to this much (on a node: until /run is full)."""
RUN_MIB = 4 * WRITE_MIB
"""The size of the tmpfs standing for the node's /run."""
BOUND = 2 * MIB
"""How far its free space may move meanwhile (the shim's own records); a container that
wrote the files moves it 3 * WRITE_MIB."""

# As root with CAP_SYS_ADMIN: first the bind made writable again in the guest (it may be:
# the guest is the pod's; the host's file must not be), then dd.
WRITE = " ; ".join(
    f"mount -o remount,bind,rw {f} && echo {f} remount=0; "
    f"dd if=/dev/zero of={f} bs=1M count={WRITE_MIB} conv=fsync 2>/dev/null; "
    f"echo {f} dd=$?" for f in FILES)


@contextlib.contextmanager
def run_tmpfs():
    """/run/podvm/<the test namespace> a tmpfs of RUN_MIB until the block ends."""
    where = pathlib.Path(paths.STATE_ROOT) / NS
    where.mkdir(parents=True, exist_ok=True)
    mounts.mount(mounts.Mount("tmpfs", "tmpfs", (f"size={RUN_MIB}m", "mode=0711")),
                 str(where))
    try:
        yield where
    finally:
        mounts.unmount(str(where))


def _free(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _used(directory: pathlib.Path) -> int:
    """Bytes the files below `directory` take on its file system (a tree of its own)."""
    total = 0
    for dirpath, _, names in os.walk(directory):
        for name in names:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
            except OSError:
                pass
    return total


async def test_a_root_container_writing_its_etc_files_fills_nothing_on_the_host(
        tmp_path, rootfs) -> None:  # noqa: F811
    with run_tmpfs():
        await _write_the_files(tmp_path, rootfs)


async def _write_the_files(tmp_path, rootfs) -> None:  # noqa: F811
    async with sandbox_shim(tmp_path) as pod:
        await pod.create(pod.config(memory=128 * MIB))
        pod_dir = pathlib.Path(paths.state_dir(NS, pod.id))
        await pod.call("StartSandbox", sb.StartSandboxRequest(sandbox_id=pod.id),
                       sb.StartSandboxResponse)
        contents = {f: (pod_dir / "etc" / f.rsplit("/", 1)[1]).read_bytes() for f in FILES}
        free, used = _free(str(pod_dir)), _used(pod_dir)

        out = await run_container(pod, tmp_path, rootfs, "writer", WRITE,
                                  capabilities=["CAP_SYS_ADMIN"])

        moved, grew = free - _free(str(pod_dir)), _used(pod_dir) - used
        assert grew < MIB and moved < BOUND, (
            f"the container's writes reached the host: the pod's state directory grew by "
            f"{grew / MIB:.1f} MiB, the free space of its file system fell by "
            f"{moved / MIB:.1f} MiB; the container said {out!r}")
        for f in FILES:  # writable in the guest, refused by the host
            assert f"{f} remount=0\n{f} dd=1\n" in out, out
            assert (pod_dir / "etc" / f.rsplit("/", 1)[1]).read_bytes() == contents[f]
        # and they still read as before inside
        out = await run_container(pod, tmp_path, rootfs, "reader", "cat /etc/hostname")
        assert out == "api-pod\nEND\n"

        await pod.call("StopSandbox", sb.StopSandboxRequest(sandbox_id=pod.id),
                       sb.StopSandboxResponse)
        await pod.call("ShutdownSandbox", sb.ShutdownSandboxRequest(sandbox_id=pod.id),
                       sb.ShutdownSandboxResponse)
        await wait_gone(pod.daemon_pid, timeout=60)
        assert not os.path.exists(pod_dir)
