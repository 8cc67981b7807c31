"""The podvm configuration: TOML with Kata's section and key names where Kata has the
same setting, plus podvm's own keys. A file may set only some keys; the rest keep their
defaults. Unknown keys and bad values fail with the key and the file named."""
from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace
from typing import Any

from podvm_core import trees
from podvm_core.cpulist import parse_cpu_list

DEFAULT_PATH = "/etc/podvm/configuration.toml"
ENV_PATH = "PODVM_CONFIG"


class ConfigError(ValueError):
    pass


VIRTIO_FS_DAEMONS = ("/opt/podvm/libexec/virtiofsd", "/usr/libexec/virtiofsd")
"""The Rust virtiofsd, the maintained one: podvm's own (`make install` and the node bundle
put it there, podvm_node/rust_virtiofsd.py), then the distribution's (Debian 13 and
later, Ubuntu 24.04, Fedora). Never QEMU 7.2's C one unless the operator names it."""
LEGACY_VIRTIO_FS_DAEMONS = ("/usr/lib/qemu/virtiofsd",)
"""QEMU 7.2's C virtiofsd (Debian 12's qemu-system-common; QEMU 8.0 dropped it), where
Debian installs it. It keeps a descriptor on its own /proc after it hides /proc, through
which a guest that took it over writes /proc/sys/kernel/core_pattern as root: it runs
only with allow_legacy_virtiofsd (shim/vm/virtiofsd.py refuses it, wherever it lies,
by its answer to --print-capabilities)."""


def default_virtio_fs_daemon() -> str:
    daemons = [trees.resolve(p) for p in VIRTIO_FS_DAEMONS]
    return next((p for p in daemons if os.path.isfile(p)), daemons[0])


def is_legacy_virtio_fs_daemon(path: str) -> bool:
    """`path` is (a link to) QEMU 7.2's C virtiofsd where Debian installs it."""
    real = os.path.realpath(path)
    return any(real == os.path.realpath(p) for p in LEGACY_VIRTIO_FS_DAEMONS)


@dataclass(frozen=True)
class HypervisorConfig:
    """The section [hypervisor.qemu]: the VMM, the guest it boots and the VM's defaults
    (shim/vm/hypervisor.py's VMSpec carries it). QEMU is the one VMM podvm drives; the
    keys are Kata's where Kata has the setting."""

    path: str = "/usr/bin/qemu-system-x86_64"
    kernel: str = "/usr/share/podvm/vmlinux"
    initrd: str = "/usr/share/podvm/initrd.img"
    image: str = "/usr/share/podvm/rootfs.img"
    """The guest's root filesystem (read-only erofs), mapped into every VM through
    virtio-pmem with DAX: the host's page cache holds it once for all pods."""
    accel: str = "kvm"
    default_vcpus: int = 1
    default_memory: int = 256
    default_maxvcpus: int = 0
    default_maxmemory: int = 0
    enable_annotations: tuple[str, ...] = ()
    boot_timeout: int = 30
    memory_overhead: int = 0
    """MiB the host spends on a pod beyond guest RAM (QEMU, and the shim when it is in
    the sandbox cgroup); 0 = podvm's measured figure for the accel."""
    enable_template: bool = True
    """Pods restore a template of their VM's shape instead of booting; a pod whose shape
    has none boots and its shim makes one in the background (shim/vm/template/maker.py)."""
    template_path: str = "/var/lib/podvm/templates"
    """Where templates are kept: one saved state per VM shape and guest image."""
    template_max_count: int = 8
    """The most templates kept; the least recently used go first (then pods boot)."""
    template_max_mib: int = 1024
    """The most MiB templates take on disk, holes not counted."""
    template_new_per_hour: int = 6
    """The most templates pods' shims start to make on the node in an hour (fewer than
    template_max_count: pods cannot cycle the whole store in an hour); then pods of new
    shapes boot and make none (shim/vm/template/ledger.py). `templates warm` is not
    counted."""
    template_new_per_namespace_per_hour: int = 2
    """The same bound for the pods of one Kubernetes namespace (one pod author)."""
    template_cgroup: str = "/podvm_templates"
    """The cgroup (in each hierarchy) templates are made in: beside the pods', so the
    node's reserved resources pay for them, not a pod."""
    console_log_max_kib: int = 256
    """The most of the guest's serial console kept in its console.log (the newest
    output; shim/vm/qemu/console.py)."""
    guest_kernel_hardening: bool = True
    """false: the guest kernel without its mitigations, LSMs and zeroed allocations
    (shim/vm/qemu/command.py FAST_PARAMS): faster, weaker isolation."""
    kernel_params: str = ""
    """Kata's key: parameters added to the guest kernel's command line."""
    seccompsandbox: str = "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"
    """QEMU's -sandbox option (its seccomp filter), Kata's key; "" turns it off."""
    enable_jail: bool = True
    """QEMU in its own mount namespace with only the pod's files, its capabilities cut
    (shim/vm/qemu/jail.py); false only to debug: weaker isolation."""
    jail_id_first: int = 1_800_000_000
    jail_id_count: int = 65536
    """The ids (each one a uid and the gid of the same number) that jailed QEMUs run
    as, one per VM node-wide (shim/host/jailids.py): a range no user, group or user
    namespace of the node uses (kubelet's user namespaces take 65536 per pod from
    65536 up)."""
    shared_fs: str = "virtio-fs"
    """Kata's key: how the containers' files reach the guest. "virtio-fs" (a virtiofsd
    per pod, shim/vm/virtiofsd.py) keeps POSIX semantics; "virtio-9p" is the fallback
    (QEMU's own 9p server), without locks, sockets, FIFOs or O_TMPFILE on shared files."""
    virtio_fs_daemon: str = field(default_factory=default_virtio_fs_daemon)
    """Kata's key: the virtiofsd binary; by default the first of VIRTIO_FS_DAEMONS that
    is installed: podvm's own Rust daemon on a node podvm installed."""
    allow_legacy_virtiofsd: bool = False
    """true: virtio_fs_daemon may be QEMU 7.2's C virtiofsd (LEGACY_VIRTIO_FS_DAEMONS),
    weaker isolation: a guest that takes it over reaches the host's /proc/sys as root.
    false: podvm refuses to run it (here, by its path; at its start, by what it is)."""
    virtio_fs_cache: str = "auto"
    """Kata's key: virtiofsd's cache mode, "auto", "always" or "none"."""
    scratch_disk_mib: int = 10240
    """The pod's scratch disk (a virtio-blk disk, sparse on the host, gone with the pod;
    shim/vm/scratchdisk.py): every container's writable layer is there, an overlay in
    the guest over its image from the share. Its size is the pod's own (the
    ephemeral-storage limits and emptyDir sizeLimits podvm-webhook annotates,
    shim/resources/storage.py); this is the default where none is given: once for all
    of a pod's unbounded containers and emptyDirs, or the whole disk of a pod without
    the annotation. 0: no disk, the writable layer is the host's (containerd's
    snapshot) and every file operation crosses the share."""
    scratch_path: str = "/var/lib/podvm/scratch"
    """A directory on a disk (not a tmpfs: the disks' data would be host memory) for the
    scratch disks, which have no name there, and the blank file system they start as."""
    scratch_mke2fs: str = "/sbin/mke2fs"
    """e2fsprogs' mke2fs, which makes the blank file system (once)."""
    scratch_reserve_mib: int = 1024
    """Free space on scratch_path's file system that no pod may claim: a pod whose disk
    does not fit in the free space less what running pods' disks may still take less
    this is refused before its VM boots (shim/host/diskreserve.py)."""

    @property
    def vmm_overhead_mib(self) -> int:
        return self.memory_overhead or MEASURED_OVERHEAD_MIB[self.accel]


@dataclass(frozen=True)
class RuntimeConfig:
    sandbox_cgroup_only: bool = True
    static_sandbox_resource_mgmt: bool = False
    enable_vcpus_pinning: bool = False
    sizing: str = "sum"
    """"sum": the VM gets the defaults plus the workload; "max": the larger of the two."""
    cpu_reservation: str = "shares"
    """"shares": pods share the node's CPUs by weight and quota (with the cpusets kubelet
    gives); "exclusive": a pod with an integral CPU request gets that many host CPUs for
    itself, the others share what is left."""
    reserved_cpus: str = ""
    """Host CPUs never given to a pod in exclusive mode (kubelet's reserved-cpus)."""
    overhead_cpus: str = ""
    """Host CPUs for QEMU's threads other than vCPUs (vmm/); empty: the vCPUs' CPUs."""
    disable_guest_empty_dir: bool = False
    """Kata's key. false: a pod's emptyDir volumes on a disk are the guest's own, on its
    scratch disk (shim/host/emptydir.py), as fast as the containers' roots; true: they
    are the host's directories kubelet made, shared like any host volume (kubelet then
    sees what they hold). Without a scratch disk they are always the host's."""
    allowed_vm_wide_sysctls: tuple[str, ...] = ()
    """Pod sysctls no namespace holds that a pod may still set, for its whole VM: names,
    or prefixes ending in '*' (shim/pod/sysctls.py)."""


@dataclass(frozen=True)
class Config:
    qemu: HypervisorConfig = field(default_factory=HypervisorConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    source: str = "(built-in defaults)"


# QEMU's RSS beyond guest RAM, measured on an idle pod (bench/density.py): TCG 160 MiB
# (32 MiB translation cache, 22 MiB of its own heap and arenas, 60 MiB of vmlinux and up
# to 34 MiB of the root image mapped from the host's page cache, shared by all pods, QEMU
# itself), plus the shim (28 MiB) when it lives in the sandbox cgroup, rounded up. KVM
# has no translation cache, but cannot be measured on these machines: it keeps its
# earlier figure.
MEASURED_OVERHEAD_MIB = {"tcg": 192, "kvm": 192}

# section in the file -> attribute of Config
_SECTIONS = {"hypervisor.qemu": "qemu", "runtime": "runtime"}
_ACCELS = ("kvm", "tcg")
SHARED_FS = ("virtio-fs", "virtio-9p")
_FS_CACHES = ("auto", "always", "none")
JAIL_ID_END = 1 << 31  # ids past it read as negative in some tools; (uid_t)-1 is "none"
CONSOLE_LOG_MAX_KIB = 16384  # per pod, in /run (memory): more is no log but a leak
_SIZINGS = ("sum", "max")
_RESERVATIONS = ("shares", "exclusive")
# Kernel parameters podvm sets itself or relies on (dashes read as underscores, as the
# kernel reads them): kernel_params may not carry them.
_OWN_KERNEL_PARAMS = ("console", "panic", "reboot", "maxcpus", "nr_cpus", "possible_cpus",
                      "init", "rdinit", "root", "podvm_template", "podvm_share")


def find(options_config_path: str = "") -> str | None:
    """The file to read: containerd's runtime options, then $PODVM_CONFIG, then the
    system file. None means built-in defaults (no system file installed)."""
    if options_config_path:
        return options_config_path
    if os.environ.get(ENV_PATH):
        return os.environ[ENV_PATH]
    return DEFAULT_PATH if os.path.exists(DEFAULT_PATH) else None


def load(options_config_path: str = "") -> Config:
    path = find(options_config_path)
    if path is None:
        return Config()
    import tomllib  # only when a container is created, not in the idle daemon

    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: configuration file not found") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    return parse(data, path)


def parse(data: dict[str, Any], source: str) -> Config:
    config = Config(source=source)
    for top, value in data.items():
        if top == "hypervisor" and isinstance(value, dict):
            for name, section in value.items():
                config = _apply(config, f"hypervisor.{name}", section, source)
        else:
            config = _apply(config, top, value, source)
    config = replace(config, qemu=replace(config.qemu, **{
        key: trees.resolve(getattr(config.qemu, key)) for key in TREE_PATHS}))
    _check(config, source)
    return config


TREE_PATHS = ("path", "kernel", "initrd", "image", "virtio_fs_daemon", "scratch_mke2fs")
"""Paths that name podvm's install (/opt/podvm/bin/...): a shim run from an installed
tree takes them from its own tree (podvm_core/trees.py), whatever `current` is now."""


def _apply(config: Config, section: str, values: Any, source: str) -> Config:
    attr = _SECTIONS.get(section)
    if attr is None:
        known = ", ".join(f"[{s}]" for s in _SECTIONS)
        raise ConfigError(f"{source}: unknown section [{section}] (podvm knows {known})")
    if not isinstance(values, dict):
        raise ConfigError(f"{source}: [{section}] must be a table")
    current = getattr(config, attr)
    types = {f.name: f.type for f in fields(current)}
    changes: dict[str, Any] = {}
    for key, value in values.items():
        if key not in types:
            raise ConfigError(f"{source}: unknown key {key!r} in [{section}] "
                              f"(known: {', '.join(sorted(types))})")
        changes[key] = _coerce(section, key, value, types[key], source)
    return replace(config, **{attr: replace(current, **changes)})


def _coerce(section: str, key: str, value: Any, type_: str, source: str) -> Any:
    where = f"{source}: [{section}] {key}"
    if type_ == "bool":
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where} must be true or false, got {value!r}")
    if type_ == "int":
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{where} must be an integer, got {value!r}")
    if type_ == "str":
        if isinstance(value, str):
            return value
        raise ConfigError(f"{where} must be a string, got {value!r}")
    if type_ == "tuple[str, ...]":
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return tuple(value)
        raise ConfigError(f"{where} must be a list of strings, got {value!r}")
    raise AssertionError(f"no coercion for {type_}")


def _check(config: Config, source: str) -> None:
    q = config.qemu
    where = f"{source}: [hypervisor.qemu]"
    if q.accel not in _ACCELS:
        raise ConfigError(f"{where} accel must be one of {', '.join(_ACCELS)}, got {q.accel!r}")
    if q.default_vcpus < 1:
        raise ConfigError(f"{where} default_vcpus must be at least 1, got {q.default_vcpus}")
    if q.default_memory < 64:
        raise ConfigError(f"{where} default_memory is in MiB and must be at least 64, "
                          f"got {q.default_memory}")
    if q.default_maxvcpus < 0 or (q.default_maxvcpus and q.default_maxvcpus < q.default_vcpus):
        raise ConfigError(f"{where} default_maxvcpus must be 0 (host CPUs) or at least "
                          f"default_vcpus ({q.default_vcpus}), got {q.default_maxvcpus}")
    if q.default_maxmemory < 0 or (q.default_maxmemory
                                   and q.default_maxmemory < q.default_memory):
        raise ConfigError(f"{where} default_maxmemory must be 0 (host memory) or at least "
                          f"default_memory ({q.default_memory}), got {q.default_maxmemory}")
    if config.runtime.sizing not in _SIZINGS:
        raise ConfigError(f"{source}: [runtime] sizing must be one of {', '.join(_SIZINGS)}, "
                          f"got {config.runtime.sizing!r}")
    if config.runtime.cpu_reservation not in _RESERVATIONS:
        raise ConfigError(f"{source}: [runtime] cpu_reservation must be one of "
                          f"{', '.join(_RESERVATIONS)}, got {config.runtime.cpu_reservation!r}")
    for key in ("reserved_cpus", "overhead_cpus"):
        value = getattr(config.runtime, key)
        if value:
            try:
                parse_cpu_list(value)
            except ValueError as exc:
                raise ConfigError(f"{source}: [runtime] {key}: {exc}") from None
    for pattern in config.runtime.allowed_vm_wide_sysctls:
        if not pattern or "*" in pattern[:-1]:
            raise ConfigError(f"{source}: [runtime] allowed_vm_wide_sysctls: {pattern!r} is "
                              f"neither a sysctl name nor a prefix ending in '*'")
    if q.memory_overhead < 0:
        raise ConfigError(f"{where} memory_overhead is in MiB, 0 for podvm's measured "
                          f"figure, got {q.memory_overhead}")
    if q.enable_template and not os.path.isabs(q.template_path):
        raise ConfigError(f"{where} template_path must be an absolute path, got "
                          f"{q.template_path!r}")
    _check_share_and_templates(q, where)
    if q.seccompsandbox and not q.seccompsandbox.startswith("on"):
        raise ConfigError(f"{where} seccompsandbox must be \"\" (off) or QEMU's -sandbox "
                          f"option starting with \"on\", got {q.seccompsandbox!r}")
    _check_kernel_params(q.kernel_params, where)
    if not 1 <= q.console_log_max_kib <= CONSOLE_LOG_MAX_KIB:
        raise ConfigError(f"{where} console_log_max_kib must be 1 to {CONSOLE_LOG_MAX_KIB} "
                          f"(KiB of the guest's console kept in /run; error messages quote "
                          f"it), got {q.console_log_max_kib}")
    if q.jail_id_first < 65536 or q.jail_id_count < 1 or \
            q.jail_id_first + q.jail_id_count > JAIL_ID_END:
        raise ConfigError(f"{where} jail_id_first and jail_id_count must give ids from 65536 "
                          f"up to {JAIL_ID_END - 1} (QEMU's jail: a range no user of the "
                          f"node has), got {q.jail_id_first} and {q.jail_id_count}")
    if q.boot_timeout < 1:
        raise ConfigError(f"{where} boot_timeout must be at least 1 second, "
                          f"got {q.boot_timeout}")


def _check_share_and_templates(q: HypervisorConfig, where: str) -> None:
    if not q.template_cgroup.startswith("/") or ".." in q.template_cgroup.split("/") or \
            q.template_cgroup.rstrip("/") == "":
        raise ConfigError(f"{where} template_cgroup must be an absolute cgroup path below "
                          f"the root, without '..', got {q.template_cgroup!r}")
    if q.template_max_count < 0 or q.template_max_mib < 0:
        raise ConfigError(f"{where} template_max_count and template_max_mib must be 0 (no "
                          f"templates) or more, got {q.template_max_count} and "
                          f"{q.template_max_mib}")
    for key in ("template_new_per_hour", "template_new_per_namespace_per_hour"):
        if getattr(q, key) < 0:
            raise ConfigError(f"{where} {key} must be 0 (pods make no templates) or more, "
                              f"got {getattr(q, key)}")
    if q.shared_fs not in SHARED_FS:
        raise ConfigError(f"{where} shared_fs must be one of {', '.join(SHARED_FS)}, "
                          f"got {q.shared_fs!r}")
    if q.scratch_disk_mib and not 64 <= q.scratch_disk_mib <= 1 << 24:
        raise ConfigError(f"{where} scratch_disk_mib must be 0 (no scratch disk) or 64 to "
                          f"{1 << 24} (MiB), got {q.scratch_disk_mib}")
    if q.scratch_reserve_mib < 0:
        raise ConfigError(f"{where} scratch_reserve_mib must be 0 or more (MiB), got "
                          f"{q.scratch_reserve_mib}")
    if q.scratch_disk_mib and not os.path.isabs(q.scratch_path):
        raise ConfigError(f"{where} scratch_path must be an absolute path, got "
                          f"{q.scratch_path!r}")
    if q.shared_fs == "virtio-fs" and not q.allow_legacy_virtiofsd and \
            is_legacy_virtio_fs_daemon(q.virtio_fs_daemon):
        raise ConfigError(f"{where} virtio_fs_daemon {q.virtio_fs_daemon} is QEMU 7.2's C "
                          f"virtiofsd, which a guest that takes it over leaves for the "
                          f"host's /proc: unset virtio_fs_daemon for podvm's own Rust "
                          f"daemon, or set allow_legacy_virtiofsd = true (weaker isolation)")
    if q.virtio_fs_cache not in _FS_CACHES:
        raise ConfigError(f"{where} virtio_fs_cache must be one of {', '.join(_FS_CACHES)}, "
                          f"got {q.virtio_fs_cache!r}")


def _check_kernel_params(params: str, where: str) -> None:
    if not params.isprintable():
        raise ConfigError(f"{where} kernel_params must be one printable line, got {params!r}")
    for word in params.split():
        name = word.split("=", 1)[0].lstrip("\"").replace("-", "_")
        if word == "--" or name in _OWN_KERNEL_PARAMS:
            raise ConfigError(f"{where} kernel_params may not set {word!r}: podvm sets or "
                              f"relies on {', '.join(_OWN_KERNEL_PARAMS)} and passes "
                              f"nothing after --")
