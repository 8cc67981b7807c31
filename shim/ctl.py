"""podvmctl: inspect podvm from the host (configuration now; sandboxes as they come)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from . import __version__, config


def _config(args: argparse.Namespace) -> int:
    try:
        cfg = config.load(args.file or "")
    except config.ConfigError as exc:
        print(f"podvmctl: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(dataclasses.asdict(cfg), indent=2))
        return 0
    print(f"# effective podvm configuration, from {cfg.source}")
    for section, attr in (("hypervisor.qemu", "qemu"), ("runtime", "runtime")):
        print(f"\n[{section}]")
        for key, value in dataclasses.asdict(getattr(cfg, attr)).items():
            print(f"{key} = {_toml(value)}")
    return 0


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, str):
        return json.dumps(value)
    return str(value)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="podvmctl", description=__doc__)
    p.add_argument("--version", action="version", version=f"podvmctl {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("config", help="check and print the effective configuration",
                       description="Load the configuration the shim would use (FILE, else "
                                   f"${config.ENV_PATH}, else {config.DEFAULT_PATH}, else "
                                   "built-in defaults), validate it and print every key.")
    c.add_argument("--file", help="configuration file to check instead of the lookup order")
    c.add_argument("--json", action="store_true", help="print JSON instead of TOML")
    c.set_defaults(func=_config)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
