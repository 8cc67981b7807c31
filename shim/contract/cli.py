"""containerd-shim-podvm-v2: the binary containerd runs for io.containerd.podvm.v2."""
from __future__ import annotations

import gc
import os
import sys

from .. import __version__
from .flags import USAGE, Flags, UsageError, parse


def main(argv: list[str] | None = None) -> int:
    try:
        flags = parse(sys.argv[1:] if argv is None else argv)
    except UsageError as exc:
        sys.stderr.write(f"containerd-shim-podvm-v2: {exc}\n\n{USAGE}")
        return 2
    if flags.help:
        sys.stdout.write(USAGE)
        return 0
    if flags.info:
        from .info import runtime_info  # here: no other action needs it

        sys.stdout.buffer.write(runtime_info())
        return 0
    if flags.version:
        sys.stdout.write(f"containerd-shim-podvm-v2:\n  Version:  {__version__}\n"
                         f"  Runtime:  io.containerd.podvm.v2\n")
        return 0
    # No cyclic garbage collection while importing and starting: it costs about a tenth
    # of that time and finds next to nothing. `start` and `delete` are short-lived; the
    # daemon (which `start` forks) turns it back on once it serves.
    gc.disable()
    if flags.action == "delete":
        # Here, not at the top: `delete` only, with the collector off.
        from .delete import delete

        _leave(delete(flags))
    if flags.action == "start":
        # Here, not at the top: imported with the collector off (about 1 ms of `start`).
        from .manager import start
        # `start` only: -info, -version and a daemon run by hand do without mountns.
        from ..host.mountns import MountNamespaceError

        try:
            code = start(flags, run_daemon)
        except MountNamespaceError as exc:
            sys.stderr.write(f"containerd-shim-podvm-v2: {exc}\n")
            code = 1
        _leave(code)
    return run_daemon(flags)


def _leave(code: int) -> None:
    """Exit without tearing the interpreter down (about 5 ms): containerd waits for
    `start` to exit while the daemon it forked starts on the same CPUs, and counts
    `delete`'s time to its 5 s limit. Nothing but stdio is left to flush."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_daemon(flags: Flags, sock=None, worker_parent=None) -> int:
    """Serve as the pod's daemon: on the listening socket `sock` (`start` forks the daemon
    with the one it bound), else on fd 3; `worker_parent`: the socket of the fork server's
    worker parent (shim/contract/workerparent.py)."""
    gc.disable()  # until it serves, as above
    return load_daemon()(flags, sock, worker_parent)


def load_daemon():
    """What the daemon loads before its first answer (the fork server loads it once for
    all its daemons: shim/contract/forkserver.py); its `serve`."""
    _import_asyncio_without_tls()
    _defer_protobuf_python_backend()
    # Here, not at the top: the daemon's imports, which neither `start` nor `delete` needs.
    from .daemon import serve

    return serve


def load_pod() -> None:
    """What a pod's first Create loads, its VM machinery (about 0.17 s of CPU on the pod's
    way to ready). Only the fork server loads it ahead, for its daemons: each daemon it
    forks runs a pod, whose shim loads all of it at that Create anyway, so the running
    pod's shim maps nothing more than it did (docs/design.md, "The fork server")."""
    from ..api.task import request  # each here: the fork server's load only
    from ..host import cleanup  # likewise
    from ..network import portforward  # likewise
    from ..pod import pod  # likewise

    del pod, request, portforward, cleanup  # loaded: that is all they are here for


def _import_asyncio_without_tls() -> None:
    """asyncio imports ssl (libssl and libcrypto, about 4 MB of RSS per shim) for TLS
    transports a shim never uses. Import it with ssl hidden, then unhide it for code
    that really needs it later."""
    sys.modules["ssl"] = None  # type: ignore[assignment]
    try:
        __import__("asyncio")  # for what it loads: the daemon imports it by name later
    finally:
        del sys.modules["ssl"]


_PROTOBUF_PYTHON_BACKEND = "google.protobuf.internal.python_message"


def _defer_protobuf_python_backend() -> None:
    """protobuf's descriptor pool imports its pure-Python backend (with text_format, the
    Python decoder and encoder, containers and pickle: 14 modules, about 6 ms of the
    daemon's start and 1 MB of its RSS) even where the upb C backend serves every
    message. Make it a lazy module: it loads at its first use, which upb never makes."""
    import importlib.util  # here, not at the top: `start` needs none of it

    if _PROTOBUF_PYTHON_BACKEND in sys.modules:
        return
    spec = importlib.util.find_spec(_PROTOBUF_PYTHON_BACKEND)
    if spec is None or spec.loader is None:
        return
    spec.loader = importlib.util.LazyLoader(spec.loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules[_PROTOBUF_PYTHON_BACKEND] = module
    spec.loader.exec_module(module)
    # `from google.protobuf.internal import python_message` then finds it on the package
    # without the import system reading the module's attributes, which would load it.
    package, _, name = _PROTOBUF_PYTHON_BACKEND.rpartition(".")
    setattr(sys.modules[package], name, module)


if __name__ == "__main__":
    sys.exit(main())
