"""podvm-webhook: the admission webhook's process (see packaging/kubernetes/webhook.yaml)."""
from __future__ import annotations

import argparse
import asyncio
import signal
import ssl
import sys

from shim import __version__, config
from shim.contract import log
from .metrics import Metrics
from .policy import Policy
from .server import serve
from .tls import ReloadingCertificate


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="podvm-webhook",
        description="Admit pods of podvm runtime classes with the shim's own resource model: "
                    "annotate (static mode) or warn (dynamic mode), refuse what the node "
                    "would refuse or could not run as written. HTTPS only.")
    p.add_argument("--version", action="version", version=f"podvm-webhook {__version__}")
    p.add_argument("--cert", required=True, help="TLS certificate (PEM), reloaded when it "
                                                 "changes")
    p.add_argument("--key", required=True, help="its private key (PEM)")
    p.add_argument("--config", default="",
                   help="the podvm configuration file the nodes use (default: "
                        f"${config.ENV_PATH}, else {config.DEFAULT_PATH}, else built-in "
                        "defaults)")
    p.add_argument("--runtime-class", action="append", dest="runtime_classes",
                   help="a RuntimeClass whose pods podvm runs (repeat for several; "
                        "default: podvm)")
    p.add_argument("--address", default="0.0.0.0", help="address to listen on")
    p.add_argument("--port", type=int, default=8443, help="port to listen on")
    p.add_argument("--reload-interval", type=float, default=10.0,
                   help="seconds between looks at the certificate files")
    p.add_argument("--debug", action="store_true", help="log at debug level")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    log.setup(args.debug, component="webhook")
    try:
        policy = Policy(config.load(args.config),
                        frozenset(args.runtime_classes or ["podvm"]))
        metrics = Metrics()
        cert = ReloadingCertificate(args.cert, args.key, metrics.reloaded)
    except config.ConfigError as exc:
        print(f"podvm-webhook: {exc}", file=sys.stderr)
        return 1
    except (OSError, ssl.SSLError) as exc:
        print(f"podvm-webhook: cannot load the certificate {args.cert} and key {args.key}: "
              f"{exc}", file=sys.stderr)
        return 1
    return asyncio.run(_run(policy, cert, metrics, args))


async def _run(policy: Policy, cert: ReloadingCertificate, metrics: Metrics,
               args: argparse.Namespace) -> int:
    """A signal sets `stop` rather than cancelling the server: its shutdown (bounded by
    server.SHUTDOWN_GRACE) then runs in a task that is not being cancelled."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await serve(policy, cert, metrics, args.address, args.port, args.reload_interval,
                    stop)
    except OSError as exc:
        print(f"podvm-webhook: cannot listen on {args.address}:{args.port}: {exc}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
