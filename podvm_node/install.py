"""`podvm-node install --host-root DIR [--bundle DIR]` and `podvm-node uninstall
--host-root DIR`, what the node DaemonSet runs with the host's root mounted at DIR.

install checks the host first (podvm_node/hostcheck.py: /dev/kvm where accel = "kvm",
a cgroup layout the shim knows, a containerd version and config.toml it can serve) and
refuses with one line, changing nothing; then it copies the bundle (podvm_node/bundle.py)
to /opt/podvm (a new tree renamed into place, on an upgrade too), links the shim into
/usr/local/bin (containerd 1.6 runs shims from its PATH whatever runtime_path says:
containerd/containerd#8207), writes /etc/podvm/configuration.toml if there is none,
adds podvm's runtimes through a drop-in (podvm_node/containerd_dropin.py), restarts
containerd and waits for its socket, labels the node, and makes the default shape's VM
template (`podvmctl templates warm` on the host: the node's first pod is restored, not
booted; a failure there is said, and pods boot). Each change is recorded in
/opt/podvm/.installed; uninstall undoes exactly those and restarts containerd again."""
from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from typing import Callable

from . import containerd_dropin as dropin
from . import hostcheck, hostfiles, nodelabel
from .containerd_dropin import Refusal

SHIM_LINK = "/usr/local/bin/containerd-shim-podvm-v2"
SHIM = hostfiles.PREFIX + "/bin/containerd-shim-podvm-v2"
RESTART = "nsenter --target 1 --mount -- systemctl restart containerd"
WARM = (f"nsenter --target 1 --mount -- {hostfiles.PREFIX}/bin/podvmctl templates warm "
        f"--config /etc/podvm/configuration.toml")
SOCKET_TIMEOUT = 60.0
WARM_TIMEOUT = 600.0
Restart = Callable[[], None]


def default_bundle() -> str:
    """The tree this podvm-node runs from (its Python is <bundle>/python/bin)."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(sys.executable))))


def command_restart(command: str, host: str, socket_path: str) -> Restart:
    """Run `command` (how the host runs containerd), then wait until the socket answers."""
    def restart() -> None:
        out = subprocess.run(shlex.split(command), capture_output=True, text=True,
                             timeout=120)
        if out.returncode != 0:
            raise RuntimeError(f"{command}: exited {out.returncode}: {out.stderr.strip()}")
        wait_for_socket(host + socket_path)
    return restart


def command_warm(command: str) -> Callable[[], str]:
    """Run `command` (the templates' warm-up on the host); what it said. The templates'
    VMs run in their own cgroup on the host, not in the installer's."""
    def warm() -> str:
        out = subprocess.run(shlex.split(command), capture_output=True, text=True,
                             timeout=WARM_TIMEOUT)
        if out.returncode != 0:
            raise RuntimeError(f"{command}: exited {out.returncode}: {out.stderr.strip()}")
        return out.stdout.strip()
    return warm


def wait_for_socket(path: str, timeout: float = SOCKET_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            try:
                s.connect(path)
                return
            except OSError as exc:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"containerd's socket {path} does not answer after "
                                       f"{timeout:.0f}s: {exc.strerror}") from None
        time.sleep(0.2)


def check(host: str, bundle: str, version_text: str | None,
          mountinfo: str | None = None,
          default_config: Callable[[], str | None] | None = None) -> dropin.Plan:
    """Every refusal, before anything changes; the containerd plan. `default_config`:
    the host containerd's `containerd config default` (None: asked of the host's binary,
    for a release newer than podvm-node's table only)."""
    if not os.path.isfile(os.path.join(bundle, "manifest.json")):
        raise Refusal(f"{bundle} is not a podvm bundle (no manifest.json): pass --bundle")
    hostcheck.check_kvm(host, os.path.join(bundle, "etc", "configuration.toml"))
    hostcheck.check_cgroups(*([mountinfo] if mountinfo else []))
    hostcheck.check_no_links(host, (hostfiles.PREFIX, os.path.dirname(SHIM_LINK),
                                    "/etc/podvm/configuration.toml", dropin.DROPIN,
                                    dropin.CONFIG))
    release = None if version_text is None else dropin.parse_version(version_text)
    plan = dropin.plan(host, release, default_config or
                       (lambda: hostcheck.containerd_default_config(host)))
    link = host + SHIM_LINK
    if os.path.lexists(link) and not (os.path.islink(link) and os.readlink(link) == SHIM):
        raise Refusal(f"{SHIM_LINK} exists and is not podvm-node's (make install?): "
                      f"remove it first: nothing changed")
    return plan


def install(host: str, bundle: str, restart: Restart | None = None,
            version_text: str | None = None, mountinfo: str | None = None,
            say: Callable[[str], None] = print,
            warm: Callable[[], str] | None = None,
            default_config: Callable[[], str | None] | None = None) -> None:
    """`warm`: the templates' warm-up, last (None: none); pods boot where it fails.
    `default_config`: as check's."""
    plan = check(host, bundle, version_text, mountinfo, default_config)
    record = hostfiles.load(host) or hostfiles.Record()
    before = copy.deepcopy(record)
    staged = ""
    try:
        hostfiles.make_dirs(host, os.path.dirname(hostfiles.PREFIX), record)
        staged = tempfile.mkdtemp(prefix=".podvm-", dir=host + os.path.dirname(hostfiles.PREFIX))
        os.rmdir(staged)
        hostfiles.copy_tree(bundle, staged)
        _configure(host, bundle, plan, record)
        hostfiles.save(record, staged + "/.installed")
        hostfiles.swap_in(staged, host + hostfiles.PREFIX)
    except BaseException:
        if staged:
            shutil.rmtree(staged, ignore_errors=True)
        _undo_new(host, before, record)
        raise
    say(f"podvm installed in {hostfiles.PREFIX} (containerd config version {plan.version})")
    (restart or command_restart(RESTART, host, plan.socket))()
    say("containerd restarted")
    say(nodelabel.set_label(nodelabel.VALUE))
    if warm is not None:
        try:
            say(f"templates warmed: {warm()}")
        except (OSError, RuntimeError, subprocess.TimeoutExpired) as exc:
            say(f"templates not warmed (pods boot until a pod's shim makes one): {exc}")


def _undo_new(host: str, before: hostfiles.Record, after: hostfiles.Record) -> None:
    """A failed install takes out what it added (nothing is left half-applied)."""
    if after.edit is not None and before.edit is None:
        dropin.undo_edit(host, after.edit)
    for path in set(after.files) - set(before.files):
        try:
            os.unlink(host + path)
        except FileNotFoundError:
            pass
    for directory in reversed([d for d in after.directories if d not in before.directories]):
        try:
            os.rmdir(host + directory)
        except OSError:
            pass


def _configure(host: str, bundle: str, plan: dropin.Plan, record: hostfiles.Record) -> None:
    """The shim's link, podvm's configuration if absent, the drop-in, the import."""
    hostfiles.make_dirs(host, os.path.dirname(SHIM_LINK), record)
    if not os.path.islink(host + SHIM_LINK):
        os.symlink(SHIM, host + SHIM_LINK)
        _add(record.files, SHIM_LINK)
    conf = "/etc/podvm/configuration.toml"
    if not os.path.exists(host + conf):
        hostfiles.make_dirs(host, os.path.dirname(conf), record)
        with open(os.path.join(bundle, "etc", "configuration.toml"), "rb") as f:
            _write_new(host + conf, f.read())
        _add(record.files, conf)
    hostfiles.make_dirs(host, os.path.dirname(dropin.DROPIN), record)
    if not os.path.exists(host + dropin.DROPIN):
        _add(record.files, dropin.DROPIN)
    elif dropin.DROPIN not in record.files:
        raise Refusal(f"{dropin.DROPIN} exists and is not podvm-node's: nothing changed")
    _write_new(host + dropin.DROPIN, plan.dropin_text.encode(), replace=True)
    if plan.edit is not None:
        hostfiles.make_dirs(host, os.path.dirname(dropin.CONFIG), record)
        dropin.apply_edit(host, plan.edit)
        record.config_edit = dataclasses.asdict(plan.edit)


def _add(paths: list[str], path: str) -> None:
    if path not in paths:
        paths.append(path)


def _write_new(path: str, data: bytes, replace: bool = False) -> None:
    tmp = path + ".podvm-new"
    with open(tmp, "wb") as f:
        f.write(data)
    os.chmod(tmp, 0o644)
    if not replace and os.path.exists(path):
        os.unlink(tmp)
        return
    os.rename(tmp, path)


def uninstall(host: str, restart: Restart | None = None,
              say: Callable[[str], None] = print) -> None:
    record = hostfiles.load(host)
    if record is None:
        say(f"podvm-node installed nothing here (no {hostfiles.RECORD}): nothing to do")
        return
    running = hostcheck.running_shims(host)
    if running:
        raise Refusal(f"{len(running)} podvm pod(s) still run here ({running[0]}...): "
                      f"delete them first (containerd needs the shim to): nothing changed")
    _, data = dropin.read_config(host)
    if record.edit is not None:
        say(dropin.undo_edit(host, record.edit))
    left = hostfiles.remove(host, record)
    if left:
        say(f"left in place (not empty): {', '.join(left)}")
    say(f"podvm removed from {hostfiles.PREFIX}")
    (restart or command_restart(RESTART, host, dropin.socket(data)))()
    say("containerd restarted")
    say(nodelabel.set_label(None))


def main(command: str, argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog=f"podvm-node {command}")
    parser.add_argument("--host-root", required=True,
                        help="where the host's root is mounted (/host in the DaemonSet)")
    parser.add_argument("--restart-command", default=RESTART,
                        help=f"how the host restarts containerd (default: {RESTART})")
    if command == "install":
        parser.add_argument("--bundle", default=default_bundle(),
                            help="the podvm tree to install (default: this podvm-node's)")
        parser.add_argument("--warm-command", default=WARM,
                            help=f"how the host makes its VM templates (default: {WARM}; "
                                 f"\"\": none)")
    args = parser.parse_args(argv)
    host = os.path.abspath(args.host_root).rstrip("/")
    try:
        if command == "install":
            _, data = dropin.read_config(host)
            restart = command_restart(args.restart_command, host, dropin.socket(data))
            install(host, args.bundle, restart, hostcheck.containerd_version_text(host),
                    warm=command_warm(args.warm_command) if args.warm_command else None)
        else:
            _, data = dropin.read_config(host)
            uninstall(host, command_restart(args.restart_command, host, dropin.socket(data)))
    except Refusal as exc:
        print(f"podvm-node {command}: refused: {exc}", file=sys.stderr)
        return 2
    except (OSError, RuntimeError, nodelabel.LabelError) as exc:
        print(f"podvm-node {command}: {exc}", file=sys.stderr)
        return 1
    return 0
