"""Templates: a guest booted once per VM shape and saved, then restored for each later pod
of that shape. Under TCG the guest's boot (kernel, init, the agent's Python) is ~4 s of a
pod's start; restoring its saved state is ~0.5 s, and the restored VM has translated
only what it runs after (a smaller TCG cache).

A template is the whole VM saved when its agent has opened its port (the host connected,
nothing sent) and nothing of any pod is in it: QEMU's migration stream (`<key>.vmstate`)
and the guest's RAM, the file the template's VM ran on (`<key>.vmstate.ram`, sparse:
what the guest freed is a hole). No share mounted (QEMU cannot save a VM whose 9p
export is mounted, nor one with a virtio-fs device at all: restored VMs get theirs
added), NICs with the template's MACs and nothing behind them (PlaceholderNic). QEMU
can restore a state only into a VM made the same way, so a template serves the VMs whose
command line is the same but for what the restore brings (paths, the sandbox id, the
taps): `of()` keys a template by that command line and the identity of every file it
names (QEMU, kernel, initrd, root image). A new guest image or QEMU is a new key; the
templates of files that changed are removed when the next one is saved.

Whoever can change a template controls the guest of every later pod of its shape: the
store must be root's alone and local, and is bounded (shim/vm/template/store.py); files
are made new (O_EXCL, O_NOFOLLOW) and appear by rename, and `<key>.json` records each
file's digests (one per 2 MiB chunk), which the restore checks as it reads
(shim/vm/stateload.py), and the memory file's stamp (inode, change time): a chunk the
node keeps in its page cache was checked as it was read into it (shim/vm/template/
cache.py) and is not hashed again while the file has that stamp. A template changed
since it was saved is discarded, never loaded.

What all pods restored from one template share, and Resume changes in each before any
of its processes runs: the clock (stopped when the template was saved), the kernel's
CRNG (reseeded from host entropy), the NICs' MACs (set to the pod's; QEMU announces
none after the load). What they still share: the agent's own process (its hash seed,
its address layout), whatever randomness the guest kernel drew during its boot, and so
the kernel's layout, were it randomized (the PVH-booted vmlinux is not relocated at all:
docs/guest.md, "The guest kernel's defences"), none of it a secret from another pod
(docs/design.md, "Templates"). Containers are all started after Resume.

A template has the boot size of its class, not the pod's (base_of): pods that differ by
vCPUs or whole blocks of memory share it, and each is grown to its own plan after the
restore.

Made off every pod's path (shim/vm/template/maker.py: ahead by `podvmctl templates
warm`, or in the background after a pod of a new shape booted), in a cgroup of its own,
under a lock; restored by reads past the page cache, so a pod is charged what its own
VM uses, not another's reads."""
from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import os
import time
from typing import Callable

from ...host.cleanup import remove_tree
from ...network.model import PlaceholderNic
from ...resources.update import MEMORY_BLOCK_MIB
from .. import memcopy, scratchdisk, stateload, vmm
from ..hypervisor import HypervisorError, RestoreFailed, SavedVM, VMSpec, memory_file
from . import store

log = logging.getLogger("podvm.template")



@dataclasses.dataclass(frozen=True)
class Template:
    """One shape's template in `directory`: `<key>.vmstate` (the saved VM), its memory
    beside it, and `<key>.json` (what it was made of, for people and for pruning)."""
    directory: str
    key: str
    inputs: dict[str, list]

    @property
    def state(self) -> str:
        return os.path.join(self.directory, f"{self.key}.vmstate")

    @property
    def meta(self) -> str:
        return os.path.join(self.directory, f"{self.key}.json")

    @property
    def memory(self) -> str:
        return memory_file(self.state)

    def saved(self) -> SavedVM:
        """The saved VM, with the digests recorded when it was saved; RestoreFailed when
        its metadata cannot be read."""
        try:
            with open(self.meta) as f:
                meta = json.load(f)
            if meta["format"] != store.FORMAT:  # made by another podvm: pruned by the next
                raise RestoreFailed(f"template {self.key}: format {meta['format']!r}, "
                                    f"not {store.FORMAT}")
            digests = meta["sha256"]
            inode, ctime = meta["memory_stamp"]
            return SavedVM(self.state, tuple(map(str, digests["state"])),
                           tuple(map(str, digests["memory"])), (int(inode), int(ctime)))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise RestoreFailed(f"template {self.key}: no digests in {self.meta}: "
                                f"{exc}") from None

    def exists(self) -> bool:
        return all(os.path.isfile(p) for p in (self.state, self.memory, self.meta))

    def discard(self, why: str) -> None:
        log.warning("template %s discarded: %s", self.key, why)
        store.delete(self.directory, self.key)

    def size(self) -> int:
        """Bytes on disk, its memory's holes not counted."""
        return store.size(self.directory, self.key)

    def record_use(self) -> None:
        store.record_use(self.directory, self.key)

    def lock(self) -> "_Lock | None":
        """The right to make this template, or None while another pod makes it."""
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        fd = store.lock(self.directory, self.key)
        return _Lock(fd) if fd >= 0 else None

    async def make(self, spec: VMSpec, preexec: Callable[[], None] | None,
                   max_count: int = 1 << 30, max_bytes: int = 1 << 60) -> None:
        """Boot `spec`'s VM as a template until its agent opens its port, save it. The VM
        runs in `workdir`-template beside the pod's and is gone afterwards; the files
        appear whole or not at all. The VM's boot failing raises what a boot raises (a
        pod would fail the same way); NotSaved when it booted but could not be saved.
        Then the least recently used others go until `max_count` templates take at most
        `max_bytes`, and this one too if it alone takes more."""
        started = time.monotonic()
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        tmp = f"{self.state}.{os.getpid()}.tmp"
        vm = vmm.create(dataclasses.replace(template_spec(spec), memory_path=memory_file(tmp)))
        try:
            await vm.launch(preexec=preexec)
            # Saved with the host still connected and nothing ever sent: the agent waits
            # on its first stream, which the restored pod's host continues (a host that
            # hung up first leaves the agent closing and opening its port, a state whose
            # restore can lose the first request).
            _, writer = vm.take_agent_stream()
            try:
                await vm.save(tmp)
                await vm.stop(timeout=2)
                # seconds of disk and hashing: off the loop of the shim that may make it
                digests = await asyncio.to_thread(_finish, tmp)
                os.rename(memory_file(tmp), self.memory)
                with _new_file(f"{self.meta}.tmp") as f:
                    json.dump({"format": store.FORMAT, "inputs": self.inputs,
                               "sha256": digests,
                               "memory_stamp": memcopy.file_stamp(os.lstat(self.memory)),
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
            for path in (tmp, memory_file(tmp), f"{self.meta}.tmp"):
                _unlink(path)
            remove_tree(vm.spec.workdir)
        log.info("template %s made by sandbox %s in %.2fs (%d MiB)", self.key,
                 spec.sandbox_id, time.monotonic() - started, self.size() >> 20)
        store.prune(self.directory)
        if not store.trim(self.directory, max_count, max_bytes, keep=self.key):
            self.discard(f"{self.size() >> 20} MiB alone is more than template_max_mib")


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
    """The template VM of `spec`'s shape: no taps behind its NICs, nothing it cannot save."""
    return dataclasses.replace(
        spec, sandbox_id=f"{spec.sandbox_id}-template", workdir=f"{spec.workdir}-template",
        template=True, saved=True,
        nics=tuple(PlaceholderNic(n.index, n.mtu) for n in spec.nics))


def base_of(spec: VMSpec, vcpus: int, memory_mib: int) -> VMSpec:
    """`spec`'s VM at the boot size of its class, the shape its template has: the
    configuration's default `vcpus` and `memory_mib` (the size of a pod that asks for
    nothing), plus the part of its memory that whole hot-plug blocks cannot add. The pod's
    own size is reached after the restore by the hot-plug that UpdateContainer uses
    (VMResizer.fit_booted in shim/vm/resize.py), so pods whose limits differ by
    whole blocks of memory (128Mi, 1Gi, ...) or by vCPUs share one template, and the VM
    still has exactly the plan's size. Never larger than `spec`."""
    if spec.memory_mib > memory_mib:
        memory_mib += (spec.memory_mib - memory_mib) % MEMORY_BLOCK_MIB
    return dataclasses.replace(spec, vcpus=min(spec.vcpus, vcpus),
                               memory_mib=min(spec.memory_mib, memory_mib))


def of(spec: VMSpec) -> Template:
    """The template that `spec`'s VM (its NICs attached already) would restore."""
    q = spec.hypervisor
    inputs = {name: store.identity(path) for name, path in (
        ("qemu", q.path), ("kernel", q.kernel), ("initrd", q.initrd), ("image", q.image))}
    if q.scratch_disk_mib:  # the guest has read the blank's first blocks
        inputs["scratch"] = store.identity(scratchdisk.blank(q))
    canonical = dataclasses.replace(template_spec(spec), sandbox_id="", workdir="/",
                                    shared_dir="/", memory_path="/", scratch_disk="/")
    digest = hashlib.sha256(json.dumps({
        "format": store.FORMAT, "inputs": inputs,
        "command": vmm.create(canonical).command()}, sort_keys=True).encode())
    return Template(q.template_path, digest.hexdigest()[:32], inputs)


def _finish(state: str) -> dict[str, list[str]]:
    """The saved VM's memory made sparse and settled; the digests of both files."""
    memcopy.dig_holes(memory_file(state))
    _settle(memory_file(state))
    return {"state": stateload.digest(state), "memory": stateload.digest(memory_file(state))}


def _new_file(path: str):
    """`path` made new for writing: never an existing file, nor a symlink's target."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW |
                             os.O_CLOEXEC, 0o600), "w")


def _settle(path: str) -> None:
    """The template's memory on disk, and out of the page cache (the pod that made it
    would be charged for it): its VM, which wrote it through a shared mapping, is gone.
    The file is the shim's again: the maker's jailed QEMU owned it (JailId.give), and
    that uid goes back to the node's pool, for the next pod's QEMU."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        os.fchown(fd, os.getuid(), os.getgid())
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
