"""A pod's sysctls (PodSandboxConfig.linux.sysctls; the sandbox container's
linux.sysctl): the guest sets them in the pod's namespaces, which is what they mean on
runc. A sysctl that no namespace holds is the guest kernel's own: setting it would change
the whole VM, so both APIs refuse it before anything boots, unless the configuration
lists it ([runtime] allowed_vm_wide_sysctls).

Namespaced, as Kubernetes and runc count them: kernel.shm*, kernel.msg*, kernel.sem and
fs.mqueue.* (ipc), kernel.domainname (uts), and net.* (network) but for the few the
kernel keeps in the initial network namespace alone (_VM_WIDE_NET). kernel.hostname is
namespaced too, but refused as runc refuses it: PodSandboxConfig.hostname sets it."""
from __future__ import annotations

from collections.abc import Mapping

from podvm_core.sysctl import dotted, proc_path

from .. import config
from .errors import Refused

_IPC_PREFIXES = ("kernel.shm", "kernel.msg", "fs.mqueue.")
_IPC_NAMES = frozenset({"kernel.sem", "kernel.sem_next_id"})
_UTS_NAMES = frozenset({"kernel.domainname"})

# net.* files that exist in the initial network namespace only, so not per pod: listed
# from the guest kernel (6.1) as the files under /proc/sys/net that a new network
# namespace lacks (tests/guest/test_sysctl_namespaces.py lists them again).
_VM_WIDE_NET_PREFIXES = ("net.ipv4.neigh.default.", "net.ipv6.neigh.default.")
_VM_WIDE_NET = frozenset(f"net.{name}" for name in (
    *(f"core.{n}" for n in (
        "bpf_jit_enable", "bpf_jit_harden", "bpf_jit_kallsyms", "bpf_jit_limit", "busy_poll",
        "busy_read", "default_qdisc", "dev_weight", "dev_weight_rx_bias",
        "dev_weight_tx_bias", "devconf_inherit_init_net", "fb_tunnels_only_for_init_net",
        "flow_limit_cpu_bitmap", "flow_limit_table_len", "gro_normal_batch",
        "high_order_alloc_disable", "max_skb_frags", "mem_pcpu_rsv", "message_burst",
        "message_cost", "netdev_budget", "netdev_budget_usecs", "netdev_max_backlog",
        "netdev_rss_key", "netdev_tstamp_prequeue", "netdev_unregister_timeout_secs",
        "optmem_max", "rmem_default", "rmem_max", "rps_sock_flow_entries", "skb_defer_max",
        "tstamp_allow_data", "warnings", "wmem_default", "wmem_max")),
    *(f"ipv4.{n}" for n in (
        "cipso_cache_bucket_size", "cipso_cache_enable", "cipso_rbm_optfmt",
        "cipso_rbm_strictvalid", "fib_sync_mem", "inet_peer_maxttl", "inet_peer_minttl",
        "inet_peer_threshold", "ipfrag_secret_interval", "tcp_available_ulp",
        "tcp_low_latency", "tcp_max_orphans", "tcp_mem", "udp_mem")),
    *(f"ipv4.route.{n}" for n in (
        "error_burst", "error_cost", "gc_elasticity", "gc_interval", "gc_min_interval",
        "gc_min_interval_ms", "gc_thresh", "gc_timeout", "max_size", "redirect_load",
        "redirect_number", "redirect_silence")),
    *(f"ipv6.{n}" for n in (
        "calipso_cache_bucket_size", "calipso_cache_enable", "ip6frag_secret_interval",
        "mld_max_msf", "mld_qrv")),
    "netfilter.nf_log_all_netns",
))


def namespace_of(name: str) -> str | None:
    """The OCI namespace that holds the sysctl `name` (dotted), None for the kernel's own."""
    if name in _IPC_NAMES or name.startswith(_IPC_PREFIXES):
        return "ipc"
    if name in _UTS_NAMES:
        return "uts"
    if name.startswith("net.") and name not in _VM_WIDE_NET \
            and not name.startswith(_VM_WIDE_NET_PREFIXES):
        return "network"
    return None


def allowed(name: str, patterns: tuple[str, ...]) -> bool:
    """Whether `patterns` (kubelet's allowed-unsafe-sysctls syntax: a name, or a prefix
    ending in '*') let the VM-wide sysctl `name` through."""
    return any(name == p or (p.endswith("*") and name.startswith(p[:-1])) for p in patterns)


def check_pod_sysctls(sysctls: Mapping[str, str], cfg: config.Config) -> None:
    """Refuse (INVALID_ARGUMENT, naming the sysctl and why) what the guest must not set
    for the pod; nothing has been made yet when this is asked."""
    if not isinstance(sysctls, Mapping):
        raise Refused(f"pod sysctls: {sysctls!r} is not a map of names to values")
    for raw, value in sorted(sysctls.items()):
        try:
            proc_path(raw)
        except ValueError as exc:
            raise Refused(f"pod sysctl: {exc}") from None
        name = dotted(raw)
        if name == "kernel.hostname":
            raise Refused((
                f"pod sysctl {raw}={value}: conflicts with the pod's hostname "
                f"(PodSandboxConfig.hostname sets it), as on runc"))
        if namespace_of(name) is None and not allowed(name, cfg.runtime.allowed_vm_wide_sysctls):
            raise Refused((
                f"pod sysctl {raw}={value}: not namespaced (no ipc, uts or network "
                f"namespace holds it), so in podvm's VM it would change the whole guest "
                f"kernel, not the pod's namespaces; a pod may set kernel.shm*, kernel.msg*, "
                f"kernel.sem, fs.mqueue.*, kernel.domainname and net.* but for the few "
                f"global ones; to allow it anyway, list it in [runtime] "
                f"allowed_vm_wide_sysctls of {cfg.source}"))
