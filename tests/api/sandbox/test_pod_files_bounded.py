"""A root container of a "shim"-sandboxer pod writes its /etc/hosts, /etc/hostname and
/etc/resolv.conf as far as it can (`dd of=/etc/hosts`): they are podvm's files in the
pod's state directory, on the host's /run, a tmpfs on a node that containerd's, kubelet's
and every pod's sockets need. Nothing it writes may land there: the host's free space
under the state directory does not move by more than a small bound, nor the pod's
directory grow, and the files still say what podvm wrote. The namespace's directory in
/run/podvm is a tmpfs of the test's own, as /run is on a node: what lands there shows in
its free space alone, not drowned by what other programs write the machine's disk.

The same for a QEMU a guest took over (tests/vm/takeover.py: its uid, namespaces and
filters): it writes its work directory, the one directory of the node it can write,
until it is refused; that is a tmpfs of the pod's own (shim/vm/workdir.py), and the
node's /run does not move.

containerd 2.x's CRI is played by the harness over ttrpc against the real shim binary:
Debian's containerd 1.6 writes these files itself and never hands them to the shim."""
from __future__ import annotations

import contextlib
import json
import os
import pathlib

from podvm_core.pb.containerd.runtime.sandbox.v1 import sandbox_pb2 as sb
from shim.host import mounts, paths
from shim.vm import vmmlog, workdir
from tests.vm import takeover

from tests.api.sandbox.harness import MIB, NS, sandbox_shim
from tests.api.sandbox.test_podfiles import rootfs, run_container, shut_down  # noqa: F401

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

        await shut_down(pod, pod_dir)


async def test_a_qemu_taken_over_fills_its_own_bounded_directory_not_the_node_s_run(
        tmp_path, rootfs) -> None:  # noqa: F811
    with run_tmpfs():
        async with sandbox_shim(tmp_path) as pod:
            await pod.create(pod.config(memory=128 * MIB))
            pod_dir = pathlib.Path(paths.state_dir(NS, pod.id))
            await pod.call("StartSandbox", sb.StartSandboxRequest(sandbox_id=pod.id),
                           sb.StartSandboxResponse)
            qemu = json.loads((pod_dir / "sandbox.json").read_text())["qemu_pid"]
            free = _free(str(pod_dir))

            said = takeover.take_over(qemu, {"fill": _fill(str(pod_dir / "vm"))})["fill"]

            moved = free - _free(str(pod_dir))
            room = vmmlog.room_for(256) + workdir.SLACK_BYTES  # the test configuration's
            assert said.startswith("refused") and moved < BOUND, (
                f"QEMU's writes reached the node: {said}; the free space of /run fell by "
                f"{moved / MIB:.1f} MiB")
            assert int(said.split()[2]) <= room, said
            # the pod lives on, its logs no longer kept; it goes as it came
            out = await run_container(pod, tmp_path, rootfs, "after", "echo alive")
            assert out == "alive\nEND\n"
            await shut_down(pod, pod_dir)


def _fill(directory: str) -> takeover.Attempt:
    """Files of 1 MiB written into `directory` up to WRITE_MIB: "reached: wrote N bytes",
    or "refused: wrote N bytes, then <error>"."""
    def attempt(held: takeover.Held) -> str:
        written, chunk = 0, b"x" * MIB
        try:
            for n in range(WRITE_MIB):
                fd = os.open(os.path.join(directory, f"fill-{n}"),
                             os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    view = memoryview(chunk)
                    while view:
                        step = os.write(fd, view)
                        view, written = view[step:], written + step
                finally:
                    os.close(fd)
        except OSError as exc:
            return f"refused: wrote {written} bytes, then {exc}"
        return f"reached: wrote {written} bytes"
    return attempt
