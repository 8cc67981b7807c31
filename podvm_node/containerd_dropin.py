"""podvm's runtimes added to a node's containerd through a drop-in file, which config.toml
imports; what each containerd version needs, found with the real containerd.

containerd 1.6/1.7 (config `version = 2`): an imported file REPLACES each plugin section
it names as a whole (containerd/containerd#5837). Checked with Debian's 1.6.20 and
`containerd config dump`: a drop-in holding only [plugins."io.containerd.grpc.v1.cri"
.containerd.runtimes.podvm] loses the operator's sandbox_image and runc's options, and
even the built-in runc runtime (a runtimes table, in any file, replaces the built-in
map). So the 1.x drop-in carries the operator's whole CRI section as config.toml has it,
plus podvm's runtime (and runc as containerd defines it, where the operator's section
names no runtimes). The cost: while the drop-in is there, an edit to config.toml's CRI
section takes effect only when `podvm-node install` runs again (the DaemonSet's pod
restarting); the drop-in's header says so.

containerd 2.x (`version = 3`; 2.3's own is `version = 4`, which moved only the server
settings, and it reads 3 too): imports merge key by key, so the drop-in holds only
podvm's two runtimes: `podvm` (a pause container, as 1.x) and `podvm-sandboxer`
(sandboxer = "shim", podvm's Sandbox API), as packaging/containerd/config-v3.toml and
config-v3-sandboxer.toml next to it have them, in config.toml's version (containerd
refuses a drop-in of a higher version than config.toml's, and warns at each start about
one of a lower version, which it migrates).

In both, config.toml must import the drop-in: if its `imports` already matches the path
(e.g. conf.d/*.toml), config.toml is untouched; otherwise the one change made to it is
the drop-in's path put into `imports` (a new line after `version`, or the first entry
of the existing array), recorded so uninstall takes exactly those bytes out again."""
from __future__ import annotations

import fnmatch
import os
import re
import tomllib
from collections.abc import Callable
from dataclasses import dataclass

from podvmctl import tomlwrite

CONFIG = "/etc/containerd/config.toml"
DROPIN = "/etc/containerd/conf.d/podvm.toml"
PODVM_CONFIG = "/etc/podvm/configuration.toml"
CRI_V2 = "io.containerd.grpc.v1.cri"
CRI_V3 = "io.containerd.cri.v1.runtime"
GRPC_SERVER = "io.containerd.server.v1.grpc"
SUPPORTED = {(1, 6): (2,), (1, 7): (2,), (2, 0): (3,), (2, 1): (3,), (2, 2): (3,),
             (2, 3): (3, 4)}
"""containerd release -> the config versions its podvm drop-in may be written in: the one
config.toml has (a drop-in of a higher version than config.toml is refused by containerd,
one of a lower version is migrated at each start, with a warning), or where there is none,
the last, the release's own (`containerd config default`). containerd 2.3's version 4 moved
only the server settings ([grpc], [ttrpc], ...) into plugins: the CRI runtimes are the
same in 3 and 4 (cmd/containerd/server/config/config.go there, serviceMigrate)."""
LATER_MAJOR = 2
LATER_VERSIONS = (3, 4)
"""A minor of LATER_MAJOR after the table's is taken when its own `containerd config
default` is one of these versions (containerd changes the version when a plugin's
configuration moves, so an unchanged one keeps the runtimes where podvm puts them); a
release of another version, or of another major, is refused."""
KNOWN = "1.6, 1.7, 2.0-2.3, a later 2.x whose `containerd config default` is version 3 or 4"
RUNC = {"runtime_type": "io.containerd.runc.v2"}


class Refusal(Exception):
    """A host podvm-node will not change: one line saying why."""


@dataclass(frozen=True)
class Edit:
    """Bytes put into config.toml: `text` at `offset` (absent: the file was created
    with `text` as its whole content)."""
    text: str
    offset: int
    created: bool = False


@dataclass(frozen=True)
class Plan:
    version: int
    dropin_text: str
    edit: Edit | None
    socket: str
    """containerd's gRPC socket as config.toml sets it (on the host)."""


def podvm_runtime(version: int, sandboxer: bool = False) -> dict:
    runtime = {"runtime_type": "io.containerd.podvm.v2"}
    if sandboxer:
        runtime["sandboxer"] = "shim"
    runtime.update({"pod_annotations": ["io.katacontainers.*", "storage.podvm.io/*"],
                    "privileged_without_host_devices": True,
                    "options": {"ConfigPath": PODVM_CONFIG}})
    return runtime


def parse_version(text: str) -> tuple[int, int]:
    """(major, minor) from `containerd --version` ("containerd github.com/containerd/
    containerd 1.6.20~ds1 ...", "containerd containerd.io v2.0.4 ...")."""
    m = re.search(r"\sv?(\d+)\.(\d+)\.\d+", text)
    if not m:
        raise Refusal(f"cannot read containerd's version from {text.strip()[:80]!r}")
    return int(m.group(1)), int(m.group(2))


def read_config(host: str) -> tuple[str | None, dict]:
    """config.toml's text (None: there is none, containerd runs on its defaults) and
    what it says."""
    path = host + CONFIG
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        return None, {}
    except (OSError, UnicodeDecodeError) as exc:
        raise Refusal(f"cannot read {CONFIG}: {exc}") from None
    try:
        return text, tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise Refusal(f"{CONFIG} is not TOML podvm can read ({exc}): fix it first") from None


def release_config_versions(release: tuple[int, int],
                            default_config: Callable[[], str | None]) -> tuple[int, ...]:
    """The config versions podvm-node writes for `release`: the table's, or for a later
    minor of LATER_MAJOR, LATER_VERSIONS up to the one `default_config()` (that
    containerd's `containerd config default`) names."""
    if release in SUPPORTED:
        return SUPPORTED[release]
    name = f"containerd {release[0]}.{release[1]}"
    newest = max(SUPPORTED)
    if release[0] != LATER_MAJOR or release < newest:
        raise Refusal(f"{name} is not one podvm-node knows ({KNOWN}): nothing changed")
    m = re.search(r"(?m)^version\s*=\s*(\d+)", default_config() or "")
    if not m:
        raise Refusal(f"{name} is newer than podvm-node knows ({newest[0]}.{newest[1]}) "
                      f"and its `containerd config default` names no config version: "
                      f"nothing changed")
    own = int(m.group(1))
    if own not in LATER_VERSIONS:
        raise Refusal(f"{name} has config version {own} (`containerd config default`), "
                      f"not one podvm-node knows ({KNOWN}): nothing changed")
    return tuple(v for v in LATER_VERSIONS if v <= own)


def config_version(release: tuple[int, int] | None, data: dict, exists: bool,
                   default_config: Callable[[], str | None] = lambda: None) -> int:
    """The config version podvm writes: config.toml's, which must be one the release
    takes (release_config_versions); the release's own where there is no config.toml;
    without a known release, config.toml's version."""
    have = data.get("version", 1) if exists else None
    if release is not None:
        versions = release_config_versions(release, default_config)
        if have is None:
            return versions[-1]
        if have not in versions:
            raise Refusal(f"containerd {release[0]}.{release[1]} with a version {have} "
                          f"{CONFIG}: podvm-node writes version "
                          f"{' or '.join(map(str, versions))} (containerd config migrate): "
                          f"nothing changed")
        return have
    if have in (2, 3, 4):
        return have
    raise Refusal(f"cannot tell containerd's version (no containerd binary on the host, "
                  f"{CONFIG} {'has version ' + str(have) if exists else 'absent'}): "
                  f"nothing changed")


def dropin_text(version: int, data: dict) -> str:
    if version >= 3:  # 4 (containerd 2.3) has the runtimes where 3 has them
        runtimes = {"podvm": podvm_runtime(3), "podvm-sandboxer": podvm_runtime(3, True)}
        body = {"version": version,
                "plugins": {CRI_V3: {"containerd": {"runtimes": runtimes}}}}
        head = ("# podvm's runtimes, written by `podvm-node install` and removed by "
                "`podvm-node uninstall`.\n# containerd 2.x merges this into "
                f"{CONFIG} key by key.\n\n")
        return tomlwrite.dumps(body, head)
    cri = _copy(data.get("plugins", {}).get(CRI_V2, {}))
    runtimes = cri.setdefault("containerd", {}).setdefault("runtimes", {})
    if not runtimes:
        runtimes["runc"] = dict(RUNC)
    runtimes["podvm"] = podvm_runtime(2)
    head = ("# podvm's runtime, written by `podvm-node install` and removed by `podvm-node "
            "uninstall`.\n# containerd 1.x REPLACES the CRI plugin's whole section with "
            f"this one, so it holds\n# {CONFIG}'s own CRI section as it was at install, "
            "plus podvm.\n# Edited that section? Run `podvm-node install` again (restart "
            "its pod).\n\n")
    return tomlwrite.dumps({"version": 2, "plugins": {CRI_V2: cri}}, head)


def _copy(value):
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


def imports_edit(text: str | None, data: dict, version: int) -> Edit | None:
    """The change config.toml needs to import the drop-in (None: it already does)."""
    line = f"imports = [{tomlwrite.string(DROPIN)}]\n"
    if text is None:
        return Edit(f"version = {version}\n{line}", 0, created=True)
    imports = data.get("imports", [])
    if any(fnmatch.fnmatchcase(DROPIN, pattern) for pattern in imports):
        return None
    if "imports" in data:
        m = re.search(r"(?m)^imports\s*=\s*\[", text)
        if not m or _top_level_end(text) < m.start():
            raise Refusal(f"{CONFIG}: its imports are not a plain top-level array podvm "
                          f"can add to: add {DROPIN} to them and run install again")
        return Edit(f"{tomlwrite.string(DROPIN)}{', ' if imports else ''}", m.end())
    m = re.search(r"(?m)^version\s*=\s*\d+[ \t]*(#[^\n]*)?(\n|$)", text)
    if not m or _top_level_end(text) < m.start():
        raise Refusal(f"{CONFIG}: no top-level version line to put imports after")
    return Edit(line if m.group(2) else "\n" + line, m.end())


def _top_level_end(text: str) -> int:
    m = re.search(r"(?m)^\s*\[", text)
    return m.start() if m else len(text)


def socket(data: dict) -> str:
    """containerd's gRPC socket: [grpc] address up to config version 3, the server
    plugin's from version 4 (containerd 2.3, which still reads [grpc] of older files)."""
    server = data.get("plugins", {}).get(GRPC_SERVER, {}).get("address")
    return server or data.get("grpc", {}).get("address", "/run/containerd/containerd.sock")


def plan(host: str, release: tuple[int, int] | None,
         default_config: Callable[[], str | None] = lambda: None) -> Plan:
    """Everything install will write to containerd's configuration, decided before
    anything is written. `default_config`: the host containerd's `containerd config
    default`, asked only of a release newer than the table (release_config_versions)."""
    text, data = read_config(host)
    version = config_version(release, data, text is not None, default_config)
    return Plan(version, dropin_text(version, data), imports_edit(text, data, version),
                socket(data))


def apply_edit(host: str, edit: Edit) -> None:
    path = host + CONFIG
    if edit.created:
        _write(path, edit.text)
        return
    with open(path, encoding="utf-8") as f:
        text = f.read()
    _write(path, text[:edit.offset] + edit.text + text[edit.offset:])


def undo_edit(host: str, edit: Edit) -> str:
    """Take the edit out again; returns what was done (an operator's later change to the
    same bytes leaves the file as it is, said so)."""
    path = host + CONFIG
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        return f"{CONFIG} is gone: nothing to undo"
    if edit.created:
        if text != edit.text:
            return f"{CONFIG} was changed since install created it: left in place"
        os.unlink(path)
        return f"removed {CONFIG} (install created it)"
    at = edit.offset if text[edit.offset:edit.offset + len(edit.text)] == edit.text \
        else text.find(edit.text)
    if at < 0:
        return f"{CONFIG} no longer has podvm's import: left as it is"
    _write(path, text[:at] + text[at + len(edit.text):])
    return f"took podvm's import out of {CONFIG}"


def _write(path: str, text: str) -> None:
    """Replace the file's contents in place (keeping its inode, mode and owner)."""
    with open(path, "r+" if os.path.exists(path) else "w", encoding="utf-8") as f:
        f.write(text)
        f.truncate()
