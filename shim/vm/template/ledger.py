"""The bound on new template shapes: which templates pods' shims started to make in the
last hour, and for which pod author (the pod's Kubernetes namespace). Without it, a pod
author mints a new shape with each new memory remainder, and each make evicts another
pod's template from the store (its least recently used first) and costs the node a
template boot. `podvmctl templates warm` (the operator) is neither counted nor bounded.

The ledger is one small file in the template store (`new-shapes.ledger`: trusted,
root's, shim/vm/template/store.py), read and written only under the store's `making`
lock (shim/vm/template/maker.py holds it), never through a symlink, and replaced whole
by rename. A make counts when it starts: a failed one spent the node's time too. A
ledger that cannot be read as one is logged and started afresh (what it bounded is an
hour's makes, nothing else is lost); one that cannot be written refuses the make, so
that the bound holds however the disk fares."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import stat

log = logging.getLogger("podvm.template")

NAME = "new-shapes.ledger"
"""Not `<hex>.json`: the store takes those for templates (store.listing, store.prune)."""
WINDOW_S = 3600.0
"""The bounds are per hour: a make this long ago (either way, should the clock be set
back) no longer counts."""
FORMAT = 1
MAX_BYTES = 1 << 20
"""A ledger larger than this is not one podvm wrote (an hour's makes are a few lines)."""


@dataclasses.dataclass(frozen=True)
class Make:
    """One template a pod's shim started to make: when (seconds since the epoch), for
    which namespace ("" for a pod without one: `ctr run`), which template key."""
    at: float
    namespace: str
    key: str


@dataclasses.dataclass(frozen=True)
class Bounds:
    """`per_node` new templates an hour on the node, `per_namespace` for each namespace
    (the keys template_new_per_hour and template_new_per_namespace_per_hour)."""
    per_node: int
    per_namespace: int


def charge(directory: str, make: Make, bounds: Bounds) -> str:
    """`make` recorded in the ledger of `directory` and "" when it is within `bounds`;
    otherwise the line that says which bound it meets and the key to raise, with nothing
    recorded. The caller holds the store's `making` lock."""
    recent = [m for m in read(directory) if abs(make.at - m.at) < WINDOW_S]
    over = _over(recent, make.namespace, bounds)
    if over:
        return over
    try:
        write(directory, recent + [make])
    except OSError as exc:
        return f"the ledger of new shapes cannot be written in {directory}: {exc.strerror}"
    return ""


def _over(recent: list[Make], namespace: str, bounds: Bounds) -> str:
    own = sum(1 for m in recent if m.namespace == namespace)
    if own >= bounds.per_namespace:
        return (f"namespace {namespace or '(none)'} started {own} new shapes in the last "
                f"hour (template_new_per_namespace_per_hour = {bounds.per_namespace})")
    if len(recent) >= bounds.per_node:
        return (f"the node started {len(recent)} new shapes in the last hour "
                f"(template_new_per_hour = {bounds.per_node})")
    return ""


def read(directory: str) -> list[Make]:
    """The makes the ledger holds, however old; [] where there is none yet, or where it
    cannot be read as one (logged: it is started afresh)."""
    path = os.path.join(directory, NAME)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return []
    except OSError as exc:
        return _fresh(path, exc.strerror or str(exc))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_BYTES:
            return _fresh(path, "not a regular file" if not stat.S_ISREG(st.st_mode)
                          else f"{st.st_size} bytes")
        text = os.read(fd, MAX_BYTES + 1)
    except OSError as exc:
        return _fresh(path, exc.strerror or str(exc))
    finally:
        os.close(fd)
    try:
        data = json.loads(text)
        if data["format"] != FORMAT:
            return _fresh(path, f"format {data['format']!r}, not {FORMAT}")
        return [_make_of(entry) for entry in data["makes"]]
    except (ValueError, KeyError, TypeError) as exc:
        return _fresh(path, f"not a ledger: {exc}")


def write(directory: str, makes: list[Make]) -> None:
    """The ledger replaced whole by one of `makes` (a new file, then renamed)."""
    path = os.path.join(directory, NAME)
    tmp = f"{path}.tmp"
    try:
        os.unlink(tmp)  # a writer killed mid-way; the lock says none is at work
    except FileNotFoundError:
        pass
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"format": FORMAT,
                       "makes": [[m.at, m.namespace, m.key] for m in makes]}, f)
        os.rename(tmp, path)
    except OSError:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def _make_of(entry: object) -> Make:
    if not (isinstance(entry, list) and len(entry) == 3 and
            isinstance(entry[0], (int, float)) and not isinstance(entry[0], bool) and
            isinstance(entry[1], str) and isinstance(entry[2], str)):
        raise TypeError(f"an entry is [seconds, namespace, key], got {entry!r:.80}")
    return Make(float(entry[0]), entry[1], entry[2])


def _fresh(path: str, why: str) -> list[Make]:
    log.warning("ledger of new template shapes %s unreadable (%s): started afresh, the "
                "last hour's makes no longer count", path, why)
    return []
