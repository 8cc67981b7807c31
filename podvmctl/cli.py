"""podvmctl: inspect podvm from the host: its configuration, running sandboxes, and how a
manifest's pods will be sized."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from shim import __version__, config
from shim.vm.template import store as templatestore

from . import status, tomlwrite


def _config(args: argparse.Namespace) -> int:
    try:
        cfg = config.load(args.file or "")
    except config.ConfigError as exc:
        print(f"podvmctl: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(dataclasses.asdict(cfg), indent=2))
        return 0
    print(tomlwrite.dumps({"hypervisor": {"qemu": _plain(cfg.qemu)},
                           "runtime": _plain(cfg.runtime)},
                          f"# effective podvm configuration, from {cfg.source}\n\n"), end="")
    return 0


def _plain(section: object) -> dict:
    """A configuration section as TOML has it (its tuples as arrays)."""
    return {key: list(value) if isinstance(value, tuple) else value
            for key, value in dataclasses.asdict(section).items()}


def _status(args: argparse.Namespace) -> int:
    try:
        report = status.collect(status.find(args.sandbox, args.namespace or ""))
    except (status.StatusError, OSError, ValueError) as exc:
        print(f"podvmctl: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(report, indent=2) if args.json else status.render(report))
    return 0


def _templates(args: argparse.Namespace) -> int:
    try:
        q = config.load(args.config or "").qemu
    except config.ConfigError as exc:
        print(f"podvmctl: {exc}", file=sys.stderr)
        return 1
    if args.action == "warm":
        return _warm(q, args.shapes or [])
    if args.shapes:
        print("podvmctl: --shape is for `podvmctl templates warm`", file=sys.stderr)
        return 2
    directory = q.template_path
    for key in args.remove or []:
        if not templatestore.remove(directory, key):
            print(f"podvmctl: template {key} is being made: not removed", file=sys.stderr)
            return 1
        print(f"removed template {key}")
    found = templatestore.listing(directory)
    if args.json:
        print(json.dumps(found, indent=2))
    elif not args.remove:
        print(f"{len(found)} templates in {directory}, "
              f"{sum(t['bytes'] for t in found) >> 20} MiB, least recently used first")
        for t in found:
            shape = " ".join(f"{k} {v}" for k, v in t["shape"].items())
            print(f"{t['key']}  {t['bytes'] >> 20:>5} MiB  {t['hits']:>6} hits  last used "
                  f"{templatestore.age(t['last_use']):>9}  made by {t['made_by'] or '-'}"
                  f"  {shape}")
    return 0


def _warm(q: config.HypervisorConfig, shapes: list[str]) -> int:
    """The templates of the default shape (or of `shapes`) made now, ahead of any pod."""
    import asyncio  # warm only: the other commands run no VM

    from shim.vm.template import maker as templatemaker  # likewise

    try:
        wanted = [templatemaker.Shape.parse(s) for s in shapes] or \
            [templatemaker.default_shape(q)]
    except ValueError as exc:
        print(f"podvmctl: {exc}", file=sys.stderr)
        return 2
    try:
        outcomes = asyncio.run(templatemaker.warm(q, wanted))
    except templatemaker.TemplatesOff as off:
        print(f"podvmctl: templates are off: {off}", file=sys.stderr)
        return 1
    except Exception as exc:  # a boot's or a save's failure, in its own words
        print(f"podvmctl: templates warm: {exc}", file=sys.stderr)
        return 1
    for outcome in outcomes:
        print(outcome.line)
    return 0 if all(o.ready for o in outcomes) else 1


def _plan(args: argparse.Namespace) -> int:
    # Here, not at the top: `config` and `status` load neither the planner nor the
    # webhook's policy (tests/podvm_webhook/test_imports.py).
    from podvm_webhook.policy import Policy

    from . import plan  # likewise

    try:
        policy = Policy(config.load(args.config or ""),
                        frozenset(args.runtime_classes or ["podvm"]))
        verdicts = plan.plan_manifest(args.manifest, policy)
    except (config.ConfigError, plan.ManifestError) as exc:
        print(f"podvmctl: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps([plan.as_json(what, v) for what, v in verdicts], indent=2))
    else:
        print("\n".join(plan.render(what, v, policy) for what, v in verdicts), end="")
    return 0 if all(v.allowed for _, v in verdicts) else 1


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
    s = sub.add_parser("status", help="show a running sandbox: plan, VM size, cgroups, threads",
                       description="Show one sandbox as the host sees it now: its plan and "
                                   "why, the VM's size, the sandbox cgroup's limits read back "
                                   "from the kernel, every QEMU (and shim) thread with its "
                                   "role and cgroups, and any difference between Kubernetes' "
                                   "view, the VM and the host.")
    s.add_argument("sandbox", help="the pod sandbox id (as crictl pods shows it)")
    s.add_argument("--namespace", help="containerd namespace (default: the one that has it)")
    s.add_argument("--json", action="store_true", help="print JSON")
    s.set_defaults(func=_status)
    pl = sub.add_parser("plan", help="size a manifest's pods as the admission webhook will",
                        description="Judge every pod of the manifests (Pods, and the pod "
                                    "templates of Deployments, Jobs...) as podvm-webhook "
                                    "will, with the configuration the nodes use: the VM, "
                                    "the RuntimeClass overhead it needs, the annotations "
                                    "static mode writes, what is refused and why. A "
                                    "RuntimeClass in the manifests sets the pods' "
                                    "spec.overhead as the API server does. Exit status 1 "
                                    "when a pod is refused.")
    pl.add_argument("manifest", nargs="+", help="YAML or JSON file (.json read as JSON)")
    pl.add_argument("--config", help="configuration file instead of the lookup order")
    pl.add_argument("--runtime-class", action="append", dest="runtime_classes",
                    help="a RuntimeClass podvm serves (repeat; default: podvm)")
    pl.add_argument("--json", action="store_true", help="print JSON")
    pl.set_defaults(func=_plan)
    t = sub.add_parser("templates", help="list, remove or make the saved VM templates",
                       description="List the templates in template_path (the VM shape, "
                                   "size on disk, hits, last use, which pod made it), least "
                                   "recently used first; --remove KEY removes one (a pod "
                                   "restoring it meanwhile reads on; one being made is "
                                   "refused). `warm`: make the templates of the default "
                                   "shape (a pod that asks for nothing, one NIC at MTU "
                                   "1500), or of each --shape, now, ahead of any pod.")
    t.add_argument("action", nargs="?", choices=("list", "warm"), default="list")
    t.add_argument("--shape", action="append", dest="shapes", metavar="VCPUS:MIB[:NICS[:MTU]]",
                   help="warm: a pod VM's size, NIC count (default 1) and MTU (default "
                        "1500) (repeat)")
    t.add_argument("--config", help="configuration file instead of the lookup order")
    t.add_argument("--remove", action="append", metavar="KEY", help="remove it (repeat)")
    t.add_argument("--json", action="store_true", help="print JSON")
    t.set_defaults(func=_templates)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
