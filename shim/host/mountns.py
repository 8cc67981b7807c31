"""The pod's own mount namespace: every mount the shim makes for a pod (rootfs, binds into
the shared directory) lives in it, so none of them is a mountpoint in the host's namespace
(there, since Linux 3.18, rmdir and unlink of a path mounted only in another namespace
succeed: a caller may remove a volume's directory while the pod still runs, as with runc).

`start` makes it before it forks the daemon, which (with QEMU and every other child)
inherits it; the namespace and all its mounts go when the last of them exits. It is a
slave of the host's (MS_SLAVE|MS_REC on /): what the host mounts or unmounts later reaches
it where the host's mounts are shared, nothing goes back. Where they are not (a host whose
/ is private), `in_namespace` reaches the host's namespace itself: the shim's binds clone
the host's tree there (see shim/host/share.py).

setns(2) and unshare(2) refuse a process with more than one thread: each call into another
namespace is made by a forked child, which has one."""
from __future__ import annotations

import os

from podvm_core import lightjson

from ..libc import last_errno, libc

TYPE_CHECKING = False  # not typing's: importing typing is 4 ms of `start`, which imports this
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import TypeVar

    T = TypeVar("T")

CLONE_NEWNS = 0x00020000
MS_REC = 0x4000
MS_SLAVE = 0x80000

_host_ns_fd: int | None = None
"""The host's mount namespace, kept open by `start` and the daemon it forks."""


class MountNamespaceError(OSError):
    """The shim could not make or enter a mount namespace: the message says which."""


def threads() -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("Threads:")).split()[1])


def unshare_for_pod() -> None:
    """Put this process in a new mount namespace, a slave of the current one, keeping the
    current one open for `host_namespace_fd`. Raises MountNamespaceError with the reason."""
    global _host_ns_fd
    count = threads()
    if count != 1:
        raise MountNamespaceError(f"cannot make the pod's mount namespace: unshare(CLONE_NEWNS)"
                                  f" needs a single-threaded process, this one has {count}")
    host = os.open("/proc/self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
    c = libc()
    if c.unshare(CLONE_NEWNS) != 0:
        err = last_errno()
        os.close(host)
        raise MountNamespaceError(err, f"cannot make the pod's mount namespace: unshare"
                                       f"(CLONE_NEWNS): {os.strerror(err)} (the shim needs "
                                       f"CAP_SYS_ADMIN)")
    if c.mount(None, b"/", None, MS_SLAVE | MS_REC, None) != 0:
        err = last_errno()
        raise MountNamespaceError(err, f"cannot make the pod's mount namespace a slave of the "
                                       f"host's: mount --make-rslave /: {os.strerror(err)}")
    _host_ns_fd = host


def host_namespace_fd() -> int | None:
    """The host's mount namespace when this process left it (else None: it is there)."""
    return _host_ns_fd


def namespace_of(pid: int | str) -> str | None:
    """`mnt:[inode]` of a process (None when it is gone)."""
    try:
        return os.readlink(f"/proc/{pid}/ns/mnt")
    except OSError:
        return None


def in_namespace(ns: int | str, fn: Callable[..., T], *args: object) -> T:
    """`fn(*args)` run in the mount namespace `ns` (an open fd, or a path such as
    /proc/PID/ns/mnt) by a forked child; its JSON-able result, or its OSError raised here.
    Blocking (a fork and the call): for the few mount operations that need it."""
    c = libc()  # loaded before the fork: the child imports nothing
    fd = os.open(ns, os.O_RDONLY | os.O_CLOEXEC) if isinstance(ns, str) else ns
    try:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: one thread, so setns may move it
            os.close(read)
            code = 1
            try:
                if c.setns(fd, CLONE_NEWNS) != 0:
                    err = last_errno()
                    raise OSError(err, f"setns into mount namespace {ns}: {os.strerror(err)}")
                answer: dict = {"result": fn(*args)}
                code = 0
            except OSError as exc:
                answer = {"errno": exc.errno or 0, "error": str(exc)}
            except BaseException as exc:  # noqa: BLE001 - reported to the parent
                answer = {"errno": 0, "error": f"{type(exc).__name__}: {exc}"}
            finally:
                try:
                    os.write(write, lightjson.dumps(answer).encode())
                finally:
                    os._exit(code)
        os.close(write)
        with os.fdopen(read, "rb") as f:
            data = f.read()
        os.waitpid(pid, 0)
    finally:
        if isinstance(ns, str):
            os.close(fd)
    answer = lightjson.loads(data or b'{"errno": 0, "error": "the helper died"}')
    if "result" in answer:
        return answer["result"]
    if answer["errno"]:
        raise OSError(answer["errno"], answer["error"])
    raise OSError(answer["error"])
