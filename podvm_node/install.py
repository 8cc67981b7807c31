"""`podvm-node install --host-root DIR [--bundle DIR]` and `podvm-node uninstall
--host-root DIR`, what the node DaemonSet runs with the host's root mounted at DIR.

install checks the host first (podvm_node/hostcheck.py: /dev/kvm where accel = "kvm",
a cgroup layout the shim knows, a containerd version and config.toml it can serve) and
refuses with one line, changing nothing; then it copies the bundle (podvm_node/bundle.py)
to a tree of its own, /opt/podvm/<name> (<name>: 6 hex digits of the bundle's content;
its binaries' loader and scripts' Python are that tree's own), switches
/opt/podvm/current to it in one step, links the shim into /usr/local/bin through
`current` (containerd 1.6 runs shims from its PATH whatever runtime_path says:
containerd/containerd#8207), writes /etc/podvm/configuration.toml if there is none,
adds podvm's runtimes through a drop-in (podvm_node/containerd_dropin.py), restarts
containerd and waits for its socket, labels the node, and makes the default shape's VM
template (`podvmctl templates warm` on the host: the node's first pod is restored, not
booted; a failure there is said, and pods boot). Each change is recorded in
/opt/podvm/.installed; uninstall undoes exactly those and restarts containerd again.

Upgrades under running pods: a shim resolves `current` once, when containerd runs it
for a new pod, and keeps to its tree until it exits (podvm_core/trees.py: the
configuration's /opt/podvm paths are its own tree's; `delete` runs the pod's own tree's
shim), so an install while pods run changes nothing for them. A tree no process uses any
more is removed by the next install (and by `podvm-node uninstall`). Uninstall while pods
run takes out everything but the trees they use, which their shims keep; the last of
them to exit removes those and /opt/podvm (podvm_core/treegc.py)"""
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

from podvm_core import treegc, trees

from . import containerd_dropin as dropin
from . import hostcheck, hostfiles, nodelabel
from .containerd_dropin import Refusal

SHIM_LINK = "/usr/local/bin/containerd-shim-podvm-v2"
SHIM = hostfiles.CURRENT + "/bin/containerd-shim-podvm-v2"
FLAT_SHIM = hostfiles.PREFIX + "/bin/containerd-shim-podvm-v2"
"""The link's target before versioned trees (an upgrade from then replaces it)."""
RESTART = "nsenter --target 1 --mount -- systemctl restart containerd"
WARM = (f"nsenter --target 1 --mount -- {hostfiles.CURRENT}/bin/podvmctl templates warm "
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
    if os.path.lexists(link) and not (os.path.islink(link) and
                                      os.readlink(link) in (SHIM, FLAT_SHIM)):
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
    hostcheck.warn_scratch_mount(host, os.path.join(bundle, "etc", "configuration.toml"), say)
    record = hostfiles.load(host) or hostfiles.Record()
    note = _take_over_note(host, record)
    before = copy.deepcopy(record)
    name = hostfiles.tree_name(bundle)
    tree = f"{hostfiles.PREFIX}/{name}"
    _check_flat(host)
    if os.path.isdir(host + tree) and not hostfiles.same_content(bundle, host + tree):
        raise Refusal(f"{tree} holds another bundle than {bundle} (its name's 6 digits "
                      f"collide): uninstall first: nothing changed")
    staged = made = ""
    try:
        hostfiles.make_dirs(host, hostfiles.PREFIX, record)
        if hostfiles.PREFIX not in record.directories:  # an install before versioned trees
            record.directories.append(hostfiles.PREFIX)
        _remove_flat(host)
        if not os.path.isdir(host + tree):  # the same bundle again: its tree as it is
            staged = tempfile.mkdtemp(prefix=".podvm-", dir=host + hostfiles.PREFIX)
            os.rmdir(staged)
            hostfiles.copy_tree(bundle, staged)
            hostfiles.relocate(staged, tree)
            os.rename(staged, host + tree)
            staged, made = "", host + tree
        _configure(host, bundle, plan, record)
        hostfiles.save(record, host + hostfiles.RECORD + ".new")
        os.rename(host + hostfiles.RECORD + ".new", host + hostfiles.RECORD)
        hostfiles.point_current(host, name)
        if note:
            os.unlink(f"{host}{hostfiles.PREFIX}/{trees.RETIRED}")
    except BaseException:
        for path in (staged, made):
            if path:
                shutil.rmtree(path, ignore_errors=True)
        _undo_new(host, before, record)
        raise
    say(f"podvm installed in {tree} ({hostfiles.CURRENT} now; containerd config version "
        f"{plan.version})")
    collected = treegc.collect(host)
    if collected:
        say(f"removed trees no process uses any more: {', '.join(collected)}")
    in_use = [n for n in trees.names(host + hostfiles.PREFIX) if n != name]
    if in_use:
        say(f"kept for their running pods: {', '.join(in_use)} (removed by a later install "
            f"once they are gone)")
    (restart or command_restart(RESTART, host, plan.socket))()
    say("containerd restarted")
    say(nodelabel.set_label(nodelabel.VALUE))
    if warm is not None:
        try:
            say(f"templates warmed: {warm()}")
        except (OSError, RuntimeError, subprocess.TimeoutExpired) as exc:
            say(f"templates not warmed (pods boot until a pod's shim makes one): {exc}")


def _take_over_note(host: str, record: hostfiles.Record) -> list[str]:
    """An uninstall under running pods left its note (what install had made, which their
    last shim was to remove): installed again, the record has them back (the note goes
    once the install stands). Returns the note."""
    note = hostfiles.read_note(host)
    for path in note:
        if os.path.islink(host + path):
            _add(record.files, path)
        elif os.path.isdir(host + path) and path not in record.directories:
            below = [i for i, d in enumerate(record.directories)
                     if d.startswith(path + "/")]  # parents first
            record.directories.insert(below[0] if below else len(record.directories), path)
    return note


def _check_flat(host: str) -> None:
    """An install from before versioned trees (the bundle's files right in /opt/podvm) is
    replaced only with no pod on it: its shims run from those very paths."""
    if not os.path.exists(host + hostfiles.PREFIX + "/manifest.json"):
        return
    running = hostcheck.running_shims(host)
    if running:
        raise Refusal(f"{len(running)} podvm pod(s) run from {hostfiles.PREFIX} as an "
                      f"earlier podvm-node installed it, without versioned trees "
                      f"({running[0]}...): delete them first, this once: nothing changed")


def _remove_flat(host: str) -> None:
    prefix = host + hostfiles.PREFIX
    if not os.path.exists(prefix + "/manifest.json"):
        return
    for entry in os.listdir(prefix):
        path = os.path.join(prefix, entry)
        if entry == ".installed" or trees.is_name(entry):
            continue
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)


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
    elif os.readlink(host + SHIM_LINK) != SHIM:  # to the flat layout's shim
        os.symlink(SHIM, host + SHIM_LINK + ".podvm-new")
        os.rename(host + SHIM_LINK + ".podvm-new", host + SHIM_LINK)
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
    if os.path.exists(host + hostfiles.PREFIX + "/manifest.json"):  # before versioned trees
        running = hostcheck.running_shims(host)
        if running:
            raise Refusal(f"{len(running)} podvm pod(s) still run here ({running[0]}...) "
                          f"from {hostfiles.PREFIX} as an earlier podvm-node installed it: "
                          f"delete them first (their shims run from it): nothing changed")
        _remove_flat(host)
        if hostfiles.PREFIX not in record.directories:
            record.directories.append(hostfiles.PREFIX)
    _, data = dropin.read_config(host)
    if record.edit is not None:
        say(dropin.undo_edit(host, record.edit))
    left, in_use = hostfiles.remove(host, record, links=(SHIM_LINK,))
    if left:
        say(f"left in place (not empty): {', '.join(left)}")
    if in_use:
        say(f"running podvm pods keep their shims' trees ({', '.join(in_use)}) and "
            f"{SHIM_LINK} and run until deleted (no new podvm pod starts); the last of "
            f"their shims to exit removes those and {hostfiles.PREFIX}")
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
