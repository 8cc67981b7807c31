"""podvm-node's command line: each subcommand's module is loaded only when it runs (the
monitor needs prometheus_client, the installer does not)."""
from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "install": ("podvm_node.install", "put podvm on the host (containerd drop-in, /opt/podvm)"),
    "uninstall": ("podvm_node.install", "remove exactly what install added"),
    "monitor": ("podvm_node.monitor", "serve the node's sandboxes as Prometheus metrics"),
    "trees": ("podvm_node.treecollect", "remove the install trees no process uses, "
                                        "periodically"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="podvm-node", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    args, rest = parser.parse_known_args(argv)
    module = importlib.import_module(COMMANDS[args.command][0])
    return int(module.main(args.command, rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
