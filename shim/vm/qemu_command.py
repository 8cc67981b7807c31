"""QEMU's command line for a pod's VM: q35 with qboot and a PVH-booted uncompressed kernel
(fast under TCG too), the guest's root image shared read-only over virtio-pmem, room for
CPU and memory hot-plug, free page reporting, the serial console and the agent on
sockets in the VM's work directory, the pod's shared directory over virtio-9p, QEMU's
seccomp sandbox; and the kernel line the guest boots with. Pure: the template key
(shim/vm/template.py) is a hash of it."""
from __future__ import annotations

import os

from podvm_core.protocol import AGENT_PORT

from ..config import HypervisorConfig
from .hypervisor import VMSpec, template_mac

SHARE_TAG = "podvm"
ROOT_IMAGE = "rootfs"
"""The id of the root image's memory backend and virtio-pmem device."""
QBOOT = "/usr/share/qemu/qboot.rom"
# Each skips probing a microVM does not need; measured under TCG (README, "Guest"). The second
# half skips boot work no pod VM uses (-0.4 s to /init under TCG): crypto self-tests, the
# KDF self-test, kprobe events, module-signing and encrypted-key keyrings (modules load
# unsigned-tainted, signatures are not enforced), 3 of 4 UARTs, audit, the lockup
# watchdog. ACPI, PCI, virtio, 9p and CPU/memory hot-plug are untouched, and so are the
# kernel's own defences (FAST_PARAMS below).
# swiotlb=noforce: the hot-plug area reaches above 4 GiB, for which the kernel would set
# aside 64 MiB of bounce buffers (touched at boot) that no virtio device uses.
# noreplace-smp: a VM that boots one vCPU would rewrite every LOCK prefix of the kernel
# (and of each module it loads) for a uniprocessor, and back when the pod grows: -0.12 s
# in the kernel's alternatives patching, ~0.19 s to /init under TCG (median of 4 pairs).
KERNEL_PARAMS = ("console=ttyS0 panic=1 reboot=t quiet i8042.noaux i8042.nomux i8042.nopnp "
                 "i8042.dumbkbd tsc=reliable no_timer_check rcupdate.rcu_expedited=1 "
                 "cryptomgr.notests initcall_blacklist=crypto_kdf108_init,init_kprobe_trace,"
                 "load_system_certificate_list,init_encrypted 8250.nr_uarts=1 "
                 "audit=0 nowatchdog swiotlb=noforce noreplace-smp")
# What guest_kernel_hardening = false adds: the guest kernel's defences against its own
# processes (a container that breaks out to guest root starts there) turned off, for
# speed. Their cost, one by one, is bench/hardening_bench.py's. nokaslr changes nothing
# while the kernel is the PVH-booted vmlinux (no decompressor, so never relocated).
FAST_PARAMS = "mitigations=off nokaslr lsm=capability init_on_alloc=0"


def kernel_line(q: HypervisorConfig, template: bool) -> str:
    """The guest's kernel command line less maxcpus=: podvm's own parameters, then the
    weaker fast form if configured, the operator's kernel_params (config.py refuses
    those that would change what podvm relies on), and the template marker."""
    return " ".join(part for part in (
        KERNEL_PARAMS, "" if q.guest_kernel_hardening else FAST_PARAMS, q.kernel_params,
        TEMPLATE_PARAM if template else "") if part)


TEMPLATE_PARAM = "podvm_template=1"
"""On the kernel line of a template's VM and of those restored from it: an environment
variable of guest/init (the kernel passes on what it does not know)."""


def agent_socket(workdir: str) -> str:
    return os.path.join(workdir, "agent.sock")


def qmp_socket(workdir: str) -> str:
    return os.path.join(workdir, "qmp.sock")


def console_log(workdir: str) -> str:
    return os.path.join(workdir, "console.log")


def console_socket(workdir: str) -> str:
    """QEMU's end of the guest's serial console, copied into console_log at a bounded
    size (shim/vm/console.py)."""
    return os.path.join(workdir, "console.sock")


def command(s: VMSpec) -> list[str]:
    """The whole command line of `s`'s VM (a template's too; restoring adds -incoming)."""
    q = s.hypervisor
    image = os.path.getsize(q.image)  # all of it is mapped (its padding is a hole)
    # The hot-plug area holds the root image, then what DIMMs may add.
    maxmem = max(s.max_memory_mib, s.memory_mib) + (image >> 20)
    # TCG reserves 1 GiB for translated code by default, all of it touched in time;
    # booting translates ~60 MiB (a 32 MiB cache is flushed 3 times, 16 MiB
    # thrashes). The cache is cut into regions that the vCPU threads take as they
    # fill theirs, and a vCPU thread started later (hot-plug) needs a free one:
    # QEMU 7.2 aborts (tcg_region_initial_alloc) when the running vCPUs have taken
    # the last, which every cache size comes to between two flushes. So under TCG
    # every vCPU the VM may have is there from the start, the guest brings up only
    # `vcpus` of them (maxcpus=) and onlines the others when the pod grows: no vCPU
    # thread starts after boot, whatever the cache size.
    maxcpus = max(s.vcpus, s.max_vcpus)
    append = kernel_line(q, s.template)
    if q.accel == "tcg":
        accel, cpu, present = "tcg,thread=multi,tb-size=32", "max", maxcpus
        append += f" maxcpus={s.vcpus}"
    else:
        accel, cpu, present = "kvm", "host", s.vcpus
    return [
        q.path, "-name", f"podvm-{s.sandbox_id},debug-threads=on",
        "-machine", "q35", "-accel", accel, "-cpu", cpu,
        "-bios", QBOOT, "-nodefaults", "-nographic", "-no-user-config", "-no-reboot",
        "-S",  # paused until QMP is attached, so no early event is missed
        "-smp", f"{present},maxcpus={maxcpus}",
        "-m", f"{s.memory_mib}M,slots=8,maxmem={maxmem}M",
        "-kernel", q.kernel, "-initrd", q.initrd, "-append", append,
        "-object", f"memory-backend-file,id={ROOT_IMAGE},mem-path={q.image},"
                   f"size={image},share=on,readonly=on",
        "-device", f"virtio-pmem-pci,memdev={ROOT_IMAGE},id={ROOT_IMAGE}",
        # The pages the guest frees (its boot's, a container's) go back to the host.
        "-device", "virtio-balloon-pci,free-page-reporting=on",
        "-chardev",
        f"socket,id=console,path={console_socket(s.workdir)},server=on,wait=off",
        "-serial", "chardev:console",
        "-qmp", f"unix:{qmp_socket(s.workdir)},server=on,wait=off",
        "-device", "virtio-serial-pci,id=serial0",
        "-chardev", f"socket,id=agent,path={agent_socket(s.workdir)},server=on,wait=off",
        "-device", f"virtserialport,chardev=agent,id=agentport,name={AGENT_PORT}",
        "-fsdev", f"local,id=shared,path={s.shared_dir},security_model=none,"
                  "multidevs=remap",
        "-device", f"virtio-9p-pci,fsdev=shared,mount_tag={SHARE_TAG}",
        "-pidfile", os.path.join(s.workdir, "qemu.pid"),
        *(["-sandbox", q.seccompsandbox] if q.seccompsandbox else []),
        *(arg for nic in s.nics
          for arg in nic.qemu_args(mac=template_mac(nic.index) if s.template else "")),
    ]
