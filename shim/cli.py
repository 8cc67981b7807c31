"""containerd-shim-podvm-v2: the binary containerd runs for io.containerd.podvm.v2."""
from __future__ import annotations

import gc
import os
import sys

from . import __version__
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
    if flags.version:
        sys.stdout.write(f"containerd-shim-podvm-v2:\n  Version:  {__version__}\n"
                         f"  Runtime:  io.containerd.podvm.v2\n")
        return 0
    # No cyclic garbage collection while importing and starting: it costs about a tenth
    # of that time and finds next to nothing. `start` and `delete` are short-lived; the
    # daemon (which `start` forks) turns it back on once it serves.
    gc.disable()
    if flags.action == "start":
        from .manager import start
        code = start(flags, run_daemon)
        # containerd waits for `start` to exit while the daemon it forked starts on the
        # same CPUs: leave without tearing the interpreter down (about 5 ms); nothing but
        # stdio is left to flush.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if flags.action == "delete":
        from .manager import delete
        return delete(flags)
    return run_daemon(flags)


def run_daemon(flags: Flags, sock=None) -> int:
    """Serve as the pod's daemon: on the listening socket `sock` (`start` forks the daemon
    with the one it bound), else on fd 3."""
    gc.disable()  # until it serves, as above
    _import_asyncio_without_tls()
    from .daemon import serve  # the daemon's imports: none of `start` and `delete` needs them

    return serve(flags, sock)


def _import_asyncio_without_tls() -> None:
    """asyncio imports ssl (libssl and libcrypto, about 4 MB of RSS per shim) for TLS
    transports a shim never uses. Import it with ssl hidden, then unhide it for code
    that really needs it later."""
    sys.modules["ssl"] = None  # type: ignore[assignment]
    try:
        import asyncio  # noqa: F401
    finally:
        del sys.modules["ssl"]


if __name__ == "__main__":
    sys.exit(main())
