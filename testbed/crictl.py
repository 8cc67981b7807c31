"""A crictl-compatible command line client: `python -m testbed.crictl [flags] COMMAND`.

Tests drive containerd's CRI plugin the way kubelet and operators do, with crictl's
arguments, file formats and output, without needing the crictl binary (not packaged for
Debian 12, and no network to fetch it). testbed/cri.py runs this module, or the real
crictl when $CRICTL names one, with the same arguments.

Differences from crictl: `exec -s` exits with the command's own status and keeps its
stdout and stderr apart (crictl exits 1 with "command ... exited with N" and prints both
streams to stdout); `exec` without -s also uses ExecSync (no streaming client, so no
-i/-t); `port-forward` speaks the streaming server's websocket protocol (crictl's:
SPDY); configs are JSON (YAML only when PyYAML is installed) and may also use camelCase
names and enum names (crictl's Go decoder takes snake_case names and numbers only); only
JSON output for inspect* and info.

This module is the command line: flags, settings (testbed/crictlsettings.py), one client,
one command. The commands are testbed/crictlpods.py's, testbed/crictlcontainers.py's,
testbed/crictlstreams.py's (exec, logs, port-forward) and testbed/crictlimages.py's, with
version and info here; testbed/crictlformat.py reads and prints as crictl does.
"""
from __future__ import annotations

import argparse
import sys
import traceback

from podvm_core.pb.cri import api_pb2 as cri

from .criclient import CriClient, CriError
from .crictlcontainers import (cmd_create, cmd_inspect, cmd_ps, cmd_rm, cmd_start, cmd_stats,
                               cmd_stop, cmd_update)
from .crictlformat import ExitCode, Fatal, captured, status_info, stderr, stdout, write
from .crictlimages import cmd_images, cmd_inspecti, cmd_pull
from .crictlpods import cmd_inspectp, cmd_pods, cmd_rmp, cmd_runp, cmd_stopp
from .crictlsettings import DEFAULT_CONFIG, resolve_settings
from .crictlstreams import cmd_exec, cmd_logs, cmd_port_forward

CLIENT_VERSION = "0.1.0"  # the Version request's version, as kubelet and crictl send it


def cmd_version(c: CriClient, a: argparse.Namespace) -> None:
    r = c.runtime("Version", cri.VersionRequest(version=CLIENT_VERSION))
    write(f"Version:  {r.version}\nRuntimeName:  {r.runtime_name}\n"
          f"RuntimeVersion:  {r.runtime_version}\nRuntimeApiVersion:  {r.runtime_api_version}\n")


def cmd_info(c: CriClient, a: argparse.Namespace) -> None:
    r = c.runtime("Status", cri.StatusRequest(verbose=True))
    write(status_info(r.status, dict(r.info)) + "\n")


class _Parser(argparse.ArgumentParser):
    """argparse's, writing its help and errors where the commands write (captured())."""

    def _print_message(self, message: str, file=None) -> None:
        if message:
            (stderr() if file is sys.stderr else stdout()).write(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="crictl", description="crictl-compatible CRI client (podvm tests)",
        epilog="Environment: CONTAINER_RUNTIME_ENDPOINT, IMAGE_SERVICE_ENDPOINT, "
               "CRI_CONFIG_FILE.")
    p.add_argument("-r", "--runtime-endpoint", metavar="ENDPOINT",
                   help="CRI runtime endpoint, unix:///path")
    p.add_argument("-i", "--image-endpoint", metavar="ENDPOINT",
                   help="CRI image endpoint (default: the runtime's)")
    # dest: `stop -t` and `exec --timeout` have their own
    p.add_argument("-t", "--timeout", dest="global_timeout", metavar="DURATION",
                   help="deadline of each call, e.g. 2s (default 2s)")
    p.add_argument("-c", "--config", metavar="FILE",
                   help=f"crictl config file (default {DEFAULT_CONFIG})")
    p.add_argument("-D", "--debug", action="store_true", help="print requests and responses")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def cmd(name: str, fn, help: str) -> argparse.ArgumentParser:
        s = sub.add_parser(name, help=help, description=help)
        s.set_defaults(fn=fn)
        return s

    cmd("version", cmd_version, "runtime version")
    cmd("info", cmd_info, "runtime status and configuration (JSON)")
    s = cmd("runp", cmd_runp, "run a pod sandbox from a PodSandboxConfig file")
    s.add_argument("-r", "--runtime", help="runtime handler (RuntimeClass handler)")
    s.add_argument("config_file", metavar="pod-config.json")
    s = cmd("create", cmd_create, "create a container in a pod")
    s.add_argument("--no-pull", action="store_true", help="accepted; never pulls anyway")
    s.add_argument("pod_id", metavar="POD-ID")
    s.add_argument("container_config", metavar="container-config.json")
    s.add_argument("pod_config", metavar="pod-config.json")
    s = cmd("start", cmd_start, "start created containers")
    s.add_argument("ids", nargs="+", metavar="ID")
    s = cmd("stop", cmd_stop, "stop running containers")
    s.add_argument("-t", "--timeout", type=int, default=0, help="grace period, seconds")
    s.add_argument("ids", nargs="+", metavar="ID")
    s = cmd("rm", cmd_rm, "remove containers")
    s.add_argument("-f", "--force", action="store_true", help="stop a running one first")
    s.add_argument("-a", "--all", action="store_true", help="every container")
    s.add_argument("ids", nargs="*", metavar="ID")
    s = cmd("stopp", cmd_stopp, "stop pod sandboxes")
    s.add_argument("-a", "--all", action="store_true", help="every pod")
    s.add_argument("ids", nargs="*", metavar="ID")
    s = cmd("rmp", cmd_rmp, "remove pod sandboxes")
    s.add_argument("-f", "--force", action="store_true", help="stop a ready one first")
    s.add_argument("-a", "--all", action="store_true", help="every pod")
    s.add_argument("ids", nargs="*", metavar="ID")
    s = cmd("exec", cmd_exec, "run a command in a container (ExecSync)")
    s.add_argument("-s", "--sync", action="store_true", help="synchronously (always)")
    s.add_argument("--timeout", type=int, default=0, help="command's limit, seconds")
    s.add_argument("-i", "--interactive", action="store_true", help="not supported")
    s.add_argument("-t", "--tty", action="store_true", help="not supported")
    s.add_argument("container", metavar="ID")
    s.add_argument("cmd", nargs=argparse.REMAINDER, metavar="CMD")
    s = cmd("port-forward", cmd_port_forward, "forward a local port to a pod's port")
    s.add_argument("pod", metavar="POD-ID")
    s.add_argument("ports", metavar="[LOCAL_PORT:]REMOTE_PORT")
    s = cmd("logs", cmd_logs, "print a container's log")
    s.add_argument("--tail", type=int, help="only the last N lines")
    s.add_argument("-t", "--timestamps", action="store_true", help="show timestamps")
    s.add_argument("-f", "--follow", action="store_true", help="until the container stops")
    s.add_argument("container", metavar="ID")
    s = cmd("ps", cmd_ps, "list containers")
    s.add_argument("-a", "--all", action="store_true", help="not only running ones")
    s.add_argument("-q", "--quiet", action="store_true", help="only IDs")
    s.add_argument("-p", "--pod", help="only this pod's")
    s.add_argument("--id", help="only this container")
    s.add_argument("--name", help="name regular expression")
    s.add_argument("--state", help="created, running, exited or unknown")
    s.add_argument("--label", action="append", help="key=value")
    s.add_argument("-l", "--latest", action="store_true", help="only the newest")
    s.add_argument("-o", "--output", choices=("table", "json"), default="table")
    s = cmd("pods", cmd_pods, "list pod sandboxes")
    s.add_argument("-q", "--quiet", action="store_true", help="only IDs")
    s.add_argument("--id", help="only this pod")
    s.add_argument("--name", help="name regular expression")
    s.add_argument("--namespace", help="namespace regular expression")
    s.add_argument("--state", help="ready or notready")
    s.add_argument("--label", action="append", help="key=value")
    s.add_argument("-l", "--latest", action="store_true", help="only the newest")
    s.add_argument("-o", "--output", choices=("table", "json"), default="table")
    for name, fn, what in (("inspect", cmd_inspect, "container"),
                           ("inspectp", cmd_inspectp, "pod sandbox")):
        s = cmd(name, fn, f"{what} status and info (JSON)")
        s.add_argument("-o", "--output", choices=("json",), default="json")
        s.add_argument("ids", nargs="+", metavar="ID")
    s = cmd("inspecti", cmd_inspecti, "image status and info (JSON)")
    s.add_argument("-o", "--output", choices=("json",), default="json")
    s.add_argument("images", nargs="+", metavar="IMAGE")
    s = cmd("stats", cmd_stats, "container resource usage")
    s.add_argument("-a", "--all", action="store_true", help="not only running ones")
    s.add_argument("--id", help="only this container")
    s.add_argument("-p", "--pod", help="only this pod's")
    s.add_argument("-s", "--seconds", type=float, default=1, help="sample interval")
    s.add_argument("-o", "--output", choices=("table", "json"), default="table")
    s.add_argument("container", nargs="?", metavar="ID")
    s = cmd("update", cmd_update, "update containers' resources")
    s.add_argument("--cpu-period", type=int, default=0)
    s.add_argument("--cpu-quota", type=int, default=0)
    s.add_argument("--cpu-share", type=int, default=0)
    s.add_argument("--memory", type=int, default=0, help="bytes")
    s.add_argument("--cpuset-cpus", default="")
    s.add_argument("--cpuset-mems", default="")
    s.add_argument("ids", nargs="+", metavar="ID")
    s = cmd("images", cmd_images, "list images")
    s.add_argument("-q", "--quiet", action="store_true", help="only IDs")
    s.add_argument("-o", "--output", choices=("table", "json"), default="table")
    s.add_argument("image", nargs="?")
    s = cmd("pull", cmd_pull, "pull an image")
    s.add_argument("image")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        runtime, image, timeout, debug = resolve_settings(args)
        with CriClient(runtime, image, timeout, stderr() if debug else None) as client:
            args.fn(client, args)
    except ExitCode as exc:
        return exc.code
    except (Fatal, CriError, ValueError) as exc:
        print(f"FATA[0000] {exc}", file=stderr())
        return 1
    return 0


def run_here(argv: list[str]) -> tuple[int, bytes, bytes]:
    """main(argv) in this process, as `python -m testbed.crictl` would run it: its exit
    status, stdout and stderr. What it writes is its own even where other threads run
    commands meanwhile (a context of its own: captured()). Not port-forward, which
    serves until a signal."""
    if "port-forward" in argv:
        raise ValueError("port-forward runs as a process of its own")
    with captured() as (out, err):
        try:
            status = main(argv)
        except SystemExit as exc:  # argparse: --help, a usage error
            status = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
        except Exception:  # as the interpreter ends a process on one: its trace, 1
            stderr().write(traceback.format_exc())
            status = 1
    return status, out.getvalue(), err.getvalue()


if __name__ == "__main__":
    sys.exit(main())
