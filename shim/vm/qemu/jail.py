"""QEMU's jail, set up in its child between fork and exec (after the sandbox cgroup is
entered: the jail hides the cgroup files), as Firecracker's jailer sets up a microVM's:
IPC, UTS and network namespaces of its own (no SysV IPC, abstract socket or address of
the node; its network namespace has only a loopback, up, for a template's placeholder
NIC: the pod's taps and vhost-net come as descriptors), and a mount namespace whose root is a
small read-only tmpfs holding, at their usual absolute paths (QEMU's command line does
not change), only what this VM uses: QEMU and its libraries, the kernel, initrd and root
image, the VM's work directory, a few device nodes and QEMU's own /proc/PID as
/proc/self; the pod's shared directory only where QEMU serves it (9p: over virtio-fs
virtiofsd does, in a sandbox of its own, shim/vm/virtiofsd.py). No /sys, no /etc but
ld.so.cache, no other pod's files. Then the capability bounding set is cut to what QEMU
needs (nothing; KEEP where it serves 9p), and QEMU becomes the uid and gid of its own
that shim/host/jailids.py handed this VM (with /dev/kvm's group under KVM): no process
of the node, and no other QEMU, shares them, so the kernel refuses QEMU their signals,
ptrace, prlimit, keyrings and files. What 9p needs is kept through the ambient set
(a uid other than 0 gets no capability from exec otherwise); no_new_privs is set:
QEMU's own `-sandbox` (seccomp) needs it without CAP_SYS_ADMIN, and nothing QEMU could
exec gains a privilege. Last, a seccomp filter of podvm's own keeps QEMU from every
other process and from the kernel's cross-process interfaces (shim/vm/qemu/pidfilter.py).
Everything is decided in the parent (`plan`); the child only makes system calls
(`Jail.enter`)."""
from __future__ import annotations

import ctypes
import fcntl
import os
import socket
import struct
from dataclasses import dataclass

from ...host import beneath
from ...libc import last_errno, libc
from ..hypervisor import VMSpec
from . import pidfilter
from .command import install_prefix

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWNET = 0x20000, 0x4000000, 0x8000000, \
    0x40000000
NAMESPACES = CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWNET
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_REMOUNT, MS_BIND, MS_REC, MS_SLAVE = 0x20, 0x1000, 0x4000, 0x80000
MNT_DETACH = 2
PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT, PR_SET_KEEPCAPS = 24, 38, 47, 8
PR_CAP_AMBIENT_RAISE, PR_CAP_AMBIENT_CLEAR_ALL = 2, 4
SYS_PIVOT_ROOT, SYS_CAPSET = 155, 126
_CAP_VERSION_3 = 0x20080522

CAPABILITIES = (
    "chown", "dac_override", "dac_read_search", "fowner", "fsetid", "kill", "setgid",
    "setuid", "setpcap", "linux_immutable", "net_bind_service", "net_broadcast",
    "net_admin", "net_raw", "ipc_lock", "ipc_owner", "sys_module", "sys_rawio",
    "sys_chroot", "sys_ptrace", "sys_pacct", "sys_admin", "sys_boot", "sys_nice",
    "sys_resource", "sys_time", "sys_tty_config", "mknod", "lease", "audit_write",
    "audit_control", "setfcap", "mac_override", "mac_admin", "syslog", "wake_alarm",
    "block_suspend", "audit_read", "perfmon", "bpf", "checkpoint_restore")
"""Linux's capability names by number (linux/capability.h)."""

KEEP = ("chown", "dac_override", "fowner", "fsetid")
"""What QEMU keeps when it serves the pod's files itself (shared_fs = "virtio-9p"; over
virtio-fs it keeps no capability and sees none of the pod's files: virtiofsd serves
them). Its 9p server (security_model=none) does what the guest's root asks
in the shared directory, as QEMU's own user: create files in directories of any owner
and mode (dac_override), chown them to the guest's owner (chown), chmod and utimes files
it does not own (fowner), keep set-id bits through chown and writes (fsetid). Nothing
else is needed (tests/vm/test_jail.py boots a guest without any other); mknod is
not kept: a guest device node in a host directory, opened through 9p, would be the
host's device opened by QEMU."""

DEVICES = ("/dev/null", "/dev/zero", "/dev/random", "/dev/urandom")
SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32",
          "/etc/ld.so.cache")
"""QEMU's binary, libraries, modules and firmware (/usr/share/qemu); on a merged-/usr
system the top-level names are symlinks into /usr and are made as such."""


class JailError(OSError):
    """The jail could not be set up: the message names the step."""

    def __str__(self) -> str:
        return str(self.strerror)


@dataclass(frozen=True)
class Bind:
    source: str
    writable: bool = False
    recursive: bool = False
    device: bool = False


@dataclass(frozen=True)
class Jail:
    root: str
    """An empty directory the tmpfs is mounted on before it becomes the root."""
    binds: tuple[Bind, ...]
    links: tuple[tuple[str, str], ...]
    """(path, target) of the symlinks made in the jail (merged /usr)."""
    ids: int
    """QEMU's uid and gid (shim/host/jailids.py)."""
    groups: tuple[int, ...] = ()
    """Its supplementary groups: /dev/kvm's under KVM, else none."""
    keep: tuple[str, ...] = KEEP

    def enter(self) -> None:
        """In QEMU's child, single-threaded, before exec: the jail, then the rights cut."""
        _call(libc().unshare(NAMESPACES), "unshare(mount, UTS, IPC, network)")
        try:
            loopback_up()
        except OSError as exc:
            raise JailError(exc.errno, f"QEMU's jail: loopback up: {exc.strerror}") from None
        _mount(None, "/", None, MS_SLAVE | MS_REC)
        _mount("podvm-qemu", self.root, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
               "size=64k,mode=0755")
        for link, target in self.links:
            os.symlink(target, self.root + link)
        for bind in self.binds:
            self._bind(bind)
        self._proc_self()
        os.mkdir(os.path.join(self.root, "old"))
        _call(libc().syscall(SYS_PIVOT_ROOT, self.root.encode(),
                             os.path.join(self.root, "old").encode()), "pivot_root")
        os.chdir("/")
        _call(libc().umount2(b"/old", MNT_DETACH), "umount2(/old)")
        os.rmdir("/old")
        _mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV
               | MS_NOEXEC)
        drop_privileges(self.keep, self.ids, self.groups)
        pidfilter.install()

    def _proc_self(self) -> None:
        """QEMU's own /proc/PID (the pid it keeps through exec) as /proc/self, and no
        other part of /proc: the guest's RAM (restored) and its scratch disk are opened
        by /proc/self/fd paths, its 9p server sets modes and owners through them
        (without it the guest cannot create a file), while a procfs would give a uid-0
        process /proc/sys and /proc/sysrq-trigger by file mode alone."""
        target = os.path.join(self.root, "proc", "self")
        os.makedirs(target, mode=0o755)
        _mount(f"/proc/{os.getpid()}", target, None, MS_BIND)
        _mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV
               | MS_NOEXEC)

    def _bind(self, bind: Bind) -> None:
        target = self.root + bind.source
        if not os.path.lexists(target):
            os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
            if os.path.isdir(bind.source):
                os.mkdir(target, 0o755)
            else:
                os.close(os.open(target, os.O_CREAT | os.O_WRONLY | os.O_CLOEXEC, 0o600))
        _mount(bind.source, target, None, MS_BIND | (MS_REC if bind.recursive else 0))
        if bind.recursive:
            # Each mount below keeps its own read-only flag (the shared directory's
            # read-only view, a container's rw rootfs); nosuid, nodev and noexec are
            # added to all there now (those attached later come with the shim's flags).
            fd = os.open(target, os.O_PATH | os.O_CLOEXEC)
            try:
                beneath.set_attributes(fd, recursive=True, attr_set=beneath.MOUNT_ATTR_NOSUID
                                       | beneath.MOUNT_ATTR_NODEV | beneath.MOUNT_ATTR_NOEXEC)
            except OSError as exc:
                raise JailError(exc.errno, f"QEMU's jail: {bind.source}: {exc}") from None
            finally:
                os.close(fd)
            return
        flags = MS_NOSUID | (0 if bind.device else MS_NODEV) | \
            (0 if bind.writable else MS_RDONLY) | \
            (MS_NOEXEC if bind.writable or bind.device else 0)
        _mount(None, target, None, MS_REMOUNT | MS_BIND | flags)


def plan(spec: VMSpec, ids: int) -> Jail:
    """The jail of `spec`'s VM, whose QEMU runs as uid and gid `ids`: its files at their
    paths, its work directory writable (the caller makes it the VM's: chown to `ids`),
    the shared directory only where QEMU serves it (9p), /dev/kvm (and its group) only
    under KVM. The tap and vhost-net devices come as descriptors, a template's state and
    the guest's RAM file too: none is a path in the jail."""
    q = spec.hypervisor
    binds: list[Bind] = []
    links: list[tuple[str, str]] = []
    for path in SYSTEM:
        if os.path.islink(path):
            links.append((path, os.readlink(path)))
        elif os.path.exists(path):
            binds.append(Bind(path))
    for path in (q.path, q.kernel, q.initrd, q.image):
        # the path QEMU is given, and where a symlink there leads (one under /usr)
        binds.extend(Bind(p) for p in {path, os.path.realpath(path)})
    binds.extend(Bind(p) for p in own_prefix(q.path))
    binds.append(Bind(spec.workdir, writable=True))
    serves_files = q.shared_fs == "virtio-9p"
    if serves_files:
        binds.append(Bind(spec.shared_dir, writable=True, recursive=True))  # as it is
    devices = DEVICES + (("/dev/kvm",) if q.accel == "kvm" else ())
    binds.extend(Bind(d, writable=True, device=True) for d in devices if os.path.exists(d))
    groups = (os.stat("/dev/kvm").st_gid,) if q.accel == "kvm" and \
        os.path.exists("/dev/kvm") else ()
    return Jail(root=os.path.join(spec.workdir, "jail"), binds=_outermost(binds),
                links=tuple(links), ids=ids, groups=groups,
                keep=KEEP if serves_files else ())


def own_prefix(qemu_path: str) -> list[str]:
    """The libraries and data of a QEMU installed under a prefix of its own (<prefix>/bin:
    podvm_node/bundle.py's /opt/podvm), which its loader and QEMU look for there; for a
    QEMU under /usr they are inside /usr, bound whole already (_outermost drops them)."""
    prefix = install_prefix(qemu_path)
    return [p for p in (os.path.join(prefix, "lib"), os.path.join(prefix, "share", "qemu"))
            if os.path.isdir(p)]


def _outermost(binds: list[Bind]) -> tuple[Bind, ...]:
    """Parents before children; a read-only path already inside a read-only bind (a
    kernel under /usr) is not bound again."""
    kept: list[Bind] = []
    for bind in sorted(binds, key=lambda b: b.source):
        inside = any(not k.writable and (bind.source + "/").startswith(k.source + "/")
                     for k in kept)
        if not (inside and not bind.writable) and bind not in kept:
            kept.append(bind)
    return tuple(kept)


def drop_privileges(keep: tuple[str, ...], ids: int, groups: tuple[int, ...] = ()) -> None:
    """Bounding set cut to `keep`; uid and gid `ids` (supplementary `groups`); the
    permitted, effective, inheritable and ambient sets exactly `keep` (what exec hands
    on to a program of a uid other than 0 is the ambient set); no_new_privs."""
    c = libc()
    wanted = {CAPABILITIES.index(name) for name in keep}
    for cap in range(last_capability() + 1):
        if cap not in wanted:
            _call(c.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), f"PR_CAPBSET_DROP {cap}")
    _call(c.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "clear ambient")
    _call(c.prctl(PR_SET_KEEPCAPS, 1 if wanted else 0, 0, 0, 0), "PR_SET_KEEPCAPS")
    try:
        os.setgroups(list(groups))
        os.setresgid(ids, ids, ids)
        os.setresuid(ids, ids, ids)
    except OSError as exc:
        raise JailError(exc.errno, f"QEMU's jail: uid and gid {ids}: {exc.strerror}") from None
    mask = sum(1 << cap for cap in wanted)
    header = (ctypes.c_uint32 * 2)(_CAP_VERSION_3, 0)
    # effective, permitted, inheritable: the low 32 bits, then the high
    data = (ctypes.c_uint32 * 6)(mask & 0xFFFFFFFF, mask & 0xFFFFFFFF, mask & 0xFFFFFFFF,
                                 mask >> 32, mask >> 32, mask >> 32)
    _call(c.syscall(SYS_CAPSET, ctypes.byref(header), ctypes.byref(data)), "capset")
    for cap in sorted(wanted):
        _call(c.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE, cap, 0, 0), f"ambient {cap}")
    _call(c.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "PR_SET_NO_NEW_PRIVS")


def loopback_up() -> None:
    """The new network namespace's loopback up: a template's placeholder NIC sends to
    127.0.0.1 (shim/network/model.py), which is then QEMU's own, not the node's."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(sock, SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(sock, SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))


def last_capability() -> int:
    try:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            return int(f.read())
    except OSError:
        return len(CAPABILITIES) - 1


def capability_names(mask: int) -> list[str]:
    return [name for bit, name in enumerate(CAPABILITIES) if mask >> bit & 1] + \
        [f"cap_{bit}" for bit in range(len(CAPABILITIES), 64) if mask >> bit & 1]


NAMESPACE_KINDS = ("mnt", "pid", "net", "ipc", "uts", "user", "cgroup")


def confinement(pid: int) -> dict:
    """How process `pid` is confined, from /proc: its uid and gid, seccomp mode (2: a
    filter), no_new_privs, its effective capabilities by name, and the namespaces it
    does not share with the caller (podvmctl run on the node: the node's; the jail's,
    virtiofsd's sandbox, the pod's mount namespace); {} when it is gone. The caller's
    own, not PID 1's: a container runtime may keep even root from /proc/1/ns."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        own = [kind for kind in NAMESPACE_KINDS
               if os.readlink(f"/proc/{pid}/ns/{kind}") != os.readlink(f"/proc/self/ns/{kind}")]
    except (OSError, KeyError):
        return {}
    return {"uid": int(fields["Uid"].split()[0]), "gid": int(fields["Gid"].split()[0]),
            "seccomp": int(fields.get("Seccomp", "0")),
            "no_new_privs": int(fields.get("NoNewPrivs", "0")),
            "capabilities": capability_names(int(fields["CapEff"], 16)),
            "own_namespaces": own}


def _mount(source: str | None, target: str, fstype: str | None, flags: int,
           data: str | None = None) -> None:
    enc = (lambda s: None if s is None else s.encode())
    _call(libc().mount(enc(source), enc(target), enc(fstype), flags, enc(data)),
          f"mount {source or ''} {target} ({flags:#x})")


def _call(result: int, what: str) -> None:
    if result != 0:
        err = last_errno()
        raise JailError(err, f"QEMU's jail: {what}: {os.strerror(err)}")


def enter_or_say(confine: Jail) -> None:
    """`confine.enter()` in QEMU's child, whose stderr is QEMU's log: a failure is
    written there, for the error the parent raises (it sees only that the child
    failed)."""
    try:
        confine.enter()
    except Exception as exc:
        os.write(2, f"podvm: {exc}\n".encode(errors="replace"))
        raise
