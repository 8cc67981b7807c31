"""Templates: a guest booted once per VM shape and saved, then restored for each later pod
of that shape. Under TCG the guest's boot (kernel, init, the agent's Python) is ~4 s of a
pod's start; restoring its saved state is ~0.5 s, and the restored VM has translated
only what it runs after (a smaller TCG cache).

A template is the whole VM (QEMU's migration stream) saved when its agent has opened its
port (the host connected, nothing sent) and nothing of any pod is in it: no 9p share
mounted (QEMU cannot save a VM whose 9p export is mounted), NICs with the template's MACs
and nothing behind them (PlaceholderNic). QEMU can restore a state only into a VM made
the same way, so a template serves the VMs whose command line is the same but for what
the restore brings (paths, the sandbox id, the taps): `of()` keys a template by that
command line and the identity of every file it names (QEMU, kernel, initrd, root image). A new guest image or QEMU is a new key; the
templates of files that changed are removed when the next one is saved.

What all pods restored from one template share, and Resume changes in each before any
of its processes runs: the clock (stopped when the template was saved), the kernel's
CRNG (reseeded from host entropy), the NICs' MACs (set to the pod's). What they still
share: the agent's own process (its hash seed, its address layout), whatever randomness
the guest kernel drew during its boot, and so the kernel's layout, were it randomized
(the PVH-booted vmlinux is not relocated at all: README, "Guest").
Containers are all started after Resume.

Made by the first pod of a shape that finds none (in its own sandbox cgroup, under a
lock: a second pod of the shape meanwhile boots as without templates), and restored with
dd reading past the page cache, so a pod is charged what its own VM uses, not another's
reads."""
from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import time
from typing import Callable

from ..host.cleanup import remove_tree
from ..network.model import PlaceholderNic
from . import vmm
from .hypervisor import HypervisorError, VMSpec

log = logging.getLogger("podvm.template")

FORMAT = 2
"""Bumped when what a template holds changes in a way its key does not show."""


@dataclasses.dataclass(frozen=True)
class Template:
    """One shape's template in `directory`: `<key>.vmstate` (the saved VM) and
    `<key>.json` (what it was made of, for people and for pruning)."""
    directory: str
    key: str
    inputs: dict[str, list]

    @property
    def state(self) -> str:
        return os.path.join(self.directory, f"{self.key}.vmstate")

    @property
    def meta(self) -> str:
        return os.path.join(self.directory, f"{self.key}.json")

    def exists(self) -> bool:
        return os.path.isfile(self.state) and os.path.isfile(self.meta)

    def discard(self, why: str) -> None:
        log.warning("template %s discarded: %s", self.key, why)
        for path in (self.state, self.meta):
            _unlink(path)

    def lock(self) -> "_Lock | None":
        """The right to make this template, or None while another pod makes it."""
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        fd = os.open(os.path.join(self.directory, f"{self.key}.lock"),
                     os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        return _Lock(fd)

    async def make(self, spec: VMSpec, preexec: Callable[[], None] | None) -> None:
        """Boot `spec`'s VM as a template until its agent opens its port, save it. The VM
        runs in `workdir`-template beside the pod's and is gone afterwards; the files
        appear whole or not at all. The VM's boot failing raises what a boot raises (a
        pod would fail the same way); NotSaved when it booted but could not be saved."""
        started = time.monotonic()
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        vm = vmm.create(template_spec(spec))
        tmp = f"{self.state}.{os.getpid()}.tmp"
        try:
            await vm.launch(preexec=preexec)
            # Saved with the host still connected and nothing ever sent: the agent waits
            # on its first stream, which the restored pod's host continues (a host that
            # hung up first leaves the agent closing and opening its port, a state whose
            # restore can lose the first request).
            _, writer = vm.take_agent_stream()
            try:
                await vm.save(tmp)
                with open(f"{self.meta}.tmp", "w") as f:
                    json.dump({"format": FORMAT, "inputs": self.inputs,
                               "command": vm.command(), "made": time.time(),
                               "made_by": spec.sandbox_id}, f, indent=1)
                os.rename(tmp, self.state)
                os.rename(f"{self.meta}.tmp", self.meta)
            except (OSError, HypervisorError) as exc:
                raise NotSaved(f"template {self.key} not saved in {self.directory}: "
                               f"{exc}") from None
            finally:
                writer.close()
        finally:
            await vm.stop(timeout=2)
            for path in (tmp, f"{self.meta}.tmp"):
                _unlink(path)
            remove_tree(vm.spec.workdir)
        log.info("template %s made by sandbox %s in %.2fs (%d MiB)", self.key,
                 spec.sandbox_id, time.monotonic() - started,
                 os.path.getsize(self.state) >> 20)
        prune(self.directory)


class NotSaved(Exception):
    """The template booted but is not in template_path (full disk, QEMU refused)."""


class _Lock:
    def __init__(self, fd: int) -> None:
        self._fd = fd

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # the flock goes with it
            self._fd = -1


def template_spec(spec: VMSpec) -> VMSpec:
    """The template VM of `spec`'s shape: no taps behind its NICs."""
    return dataclasses.replace(
        spec, sandbox_id=f"{spec.sandbox_id}-template", workdir=f"{spec.workdir}-template",
        template=True, nics=tuple(PlaceholderNic(n.index, n.mtu) for n in spec.nics))


def of(spec: VMSpec) -> Template:
    """The template that `spec`'s VM (its NICs attached already) would restore."""
    q = spec.hypervisor
    inputs = {name: _identity(path) for name, path in (
        ("qemu", q.path), ("kernel", q.kernel), ("initrd", q.initrd), ("image", q.image))}
    canonical = dataclasses.replace(template_spec(spec), sandbox_id="", workdir="/",
                                    shared_dir="/")
    digest = hashlib.sha256(json.dumps({
        "format": FORMAT, "inputs": inputs,
        "command": vmm.create(canonical).command()}, sort_keys=True).encode())
    return Template(q.template_path, digest.hexdigest()[:32], inputs)


def prune(directory: str) -> list[str]:
    """Remove the templates whose files (QEMU, kernel, initrd, image) changed or are
    gone, and states whose metadata was never written; the keys removed."""
    removed = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return removed
    for name in names:
        path = os.path.join(directory, name)
        if name.endswith(".json"):
            key = name[:-len(".json")]
            try:
                with open(path) as f:
                    meta = json.load(f)
                inputs = meta["inputs"]
                stale = meta.get("format") != FORMAT or any(
                    _identity(file_id[0]) != file_id for file_id in inputs.values())
            except (OSError, ValueError, KeyError, TypeError, IndexError):
                stale = True
            if stale:
                for suffix in (".json", ".vmstate", ".lock"):
                    _unlink(os.path.join(directory, key + suffix))
                removed.append(key)
        elif name.endswith(".vmstate") and not os.path.exists(path[:-len(".vmstate")] + ".json"):
            _unlink(path)  # its metadata was never written: an interrupted save
    if removed:
        log.info("templates of changed files removed: %s", ", ".join(removed))
    return removed


def _identity(path: str) -> list:
    """What tells a file from the next version of it: path, size, mtime, inode."""
    try:
        st = os.stat(path)
    except OSError:
        return [path, -1, -1, -1]
    return [path, st.st_size, st.st_mtime_ns, st.st_ino]


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
