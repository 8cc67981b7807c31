"""containerd-shim-podvm-v2: the binary containerd runs for io.containerd.podvm.v2."""
from __future__ import annotations

import sys

from . import __version__
from .flags import USAGE, UsageError, parse


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
    if flags.action == "start":
        from .manager import start
        return start(flags)
    if flags.action == "delete":
        from .manager import delete
        return delete(flags)
    _import_asyncio_without_tls()
    from .daemon import serve
    return serve(flags)


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
