"""QEMU's command line for a pod's VM: q35 with qboot and a PVH-booted uncompressed kernel
(fast under TCG too), the guest's root image shared read-only over virtio-pmem, room for
CPU and memory hot-plug, free page reporting, the serial console and the agent on
sockets in the VM's work directory, the pod's shared directory over virtio-fs (or 9p), the
guest's RAM shared (virtiofsd maps it), QEMU's seccomp sandbox; and the kernel line the
guest boots with. Pure: the template key (shim/vm/template/template.py) is a hash of it."""
from __future__ import annotations

import os

from podvm_core.protocol import AGENT_PORT

from ...config import HypervisorConfig
from ..hypervisor import VMSpec, template_mac
from ..virtiofsd import virtio_fs_socket

SHARE_TAG = "podvm"
RAM = "ram"
"""The id of the guest RAM's memory backend (the same in a template and its restores)."""
FS_PORT = "fsport"
"""The PCIe root port the virtio-fs device sits behind: there from boot, so that a VM
restored from a template (which cannot have the device: QEMU 7.2 neither saves nor
loads a VM with one) gets it hot-plugged there (virtio_fs_device), where its guest
finds it by a rescan of the PCI bus (guest/agent/resume.py)."""
FS_CHARDEV = "fs"
ROOT_IMAGE = "rootfs"
"""The id of the root image's memory backend and virtio-pmem device."""
QBOOT = "/usr/share/qemu/qboot.rom"


def install_prefix(qemu_path: str) -> str:
    """The prefix the QEMU at `qemu_path` is installed under (<prefix>/bin/...: /usr, or
    podvm_node/bundle.py's /opt/podvm): its loader finds its libraries in <prefix>/lib,
    QEMU its data (firmware, modules' ROMs) in <prefix>/share/qemu."""
    return os.path.dirname(os.path.dirname(os.path.realpath(qemu_path)))


def qboot(qemu_path: str) -> str:
    """The qboot of the QEMU at `qemu_path`: one installed under a prefix of its own
    carries it in that prefix's share/qemu, where QEMU itself looks for its data;
    Debian's is QBOOT."""
    beside = os.path.join(install_prefix(qemu_path), "share", "qemu", "qboot.rom")
    return beside if os.path.isfile(beside) else QBOOT


# Each skips probing a microVM does not need; measured under TCG (docs/guest.md,
# "Boot time"). The second half skips boot work no pod VM uses (-0.4 s to /init under
# TCG): crypto self-tests, the KDF self-test, kprobe events, module-signing and
# encrypted-key keyrings (modules load unsigned-tainted, signatures are not enforced), 3
# of 4 UARTs, audit, the lockup watchdog. ACPI, PCI, virtio, 9p and CPU/memory hot-plug
# are untouched, and so are the kernel's own defences (FAST_PARAMS below).
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


# Under TCG: QEMU's `max` CPU less ERMS and FSRM (fast `rep movsb`), which TCG runs a
# byte at a time; without them the guest kernel and libc copy with `rep movsq`, 8 bytes
# a step. Every file read or written in the guest is such a copy: a 64 MiB write +
# fsync in a container's root took 1.1-1.6 s against 2.2-2.5 s, 32 MiB into a tmpfs
# 0.53 against 0.82 s (one pod each). KVM gives the host's CPU, where ERMS is fast.
TCG_CPU = "max,erms=off,fsrm=off"


def kernel_line(q: HypervisorConfig, template: bool) -> str:
    """The guest's kernel command line less maxcpus=: podvm's own parameters, then the
    weaker fast form if configured, the operator's kernel_params (config.py refuses
    those that would change what podvm relies on), the share's file system and the
    template marker."""
    return " ".join(part for part in (
        KERNEL_PARAMS, "" if q.guest_kernel_hardening else FAST_PARAMS, q.kernel_params,
        f"{SHARE_PARAM}={SHARE_FS[q.shared_fs]}", TEMPLATE_PARAM if template else "")
        if part)


SHARE_PARAM = "podvm_share"
SHARE_FS = {"virtio-fs": "virtiofs", "virtio-9p": "9p"}
"""The guest's file system type of the share, by shared_fs: guest/init and the agent's
Resume mount the line of that type in the guest's fstab."""


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
    size (shim/vm/qemu/console.py)."""
    return os.path.join(workdir, "console.sock")


def _ram(s: VMSpec) -> list[str]:
    """The guest's RAM, always shared: virtiofsd reads and writes the guest's buffers in
    it. A template's is a file (what it saved besides QEMU's state:
    shim/vm/template/template.py), a restored VM's a copy of that file; a booted one's a
    memfd."""
    if s.memory_path:
        backend = f"memory-backend-file,mem-path={s.memory_path}"
    else:
        backend = "memory-backend-memfd"
    return ["-object", f"{backend},id={RAM},size={s.memory_mib}M,share=on"]


def _share(s: VMSpec) -> list[str]:
    """The pod's shared directory: virtio-fs (none on a VM to be saved), or 9p."""
    if s.hypervisor.shared_fs == "virtio-9p":
        return ["-fsdev", f"local,id=shared,path={s.shared_dir},security_model=none,"
                          "multidevs=remap",
                "-device", f"virtio-9p-pci,fsdev=shared,mount_tag={SHARE_TAG}"]
    port = ["-device", f"pcie-root-port,id={FS_PORT},chassis=1,bus=pcie.0,addr=0x10"]
    if s.template:  # saved, or restored: added once the state is loaded
        return port
    device = virtio_fs_device()
    return [*port, "-chardev", f"socket,id={FS_CHARDEV},path={virtio_fs_socket(s.workdir)}",
            "-device", ",".join([device.pop("driver"), *(f"{k}={v}" for k, v in device.items())])]


def virtio_fs_device() -> dict[str, str]:
    """The virtio-fs device's properties, QMP's device_add arguments."""
    return {"driver": "vhost-user-fs-pci", "id": "virtiofs", "chardev": FS_CHARDEV,
            "tag": SHARE_TAG, "bus": FS_PORT}


def virtio_fs_chardev(workdir: str) -> dict:
    """QMP's chardev-add arguments for the socket to virtiofsd."""
    return {"id": FS_CHARDEV, "backend": {"type": "socket", "data": {
        "addr": {"type": "unix", "data": {"path": virtio_fs_socket(workdir)}},
        "server": False}}}


SCRATCH = "scratch"
"""The id of the scratch disk's block node and virtio-blk device; its serial is
SCRATCH_SERIAL, by which the guest finds it (guest/agent/writable.py)."""
SCRATCH_SERIAL = "podvm-scratch"


def _scratch(s: VMSpec) -> list[str]:
    """The pod's scratch disk (in a template too: its state is saved with the VM, and a
    restored pod's disk is its own copy of the same blank file system). O_DIRECT: the
    guest's page cache, in the pod's RAM, is the disk's only cache (none in the host's,
    where it would be charged to the pod twice). No flush reaches the host's disk: the
    disk dies with QEMU, so nothing on it could be read after a crash that a flush
    would have kept. The guest's discards (guest/agent/writable.py trims when a layer
    goes) punch holes in the file. An error of the host's file (its file system full,
    a failing disk) is the guest's to see as an I/O error of its disk (werror and rerror
    `report`): QEMU's default, `enospc` for writes, would pause the whole VM at its next
    write, and every pod whose disk is on that file system with it."""
    if not s.hypervisor.scratch_disk_mib or not s.scratch_disk:
        return []
    return ["-blockdev", f"driver=file,node-name={SCRATCH},filename={s.scratch_disk},"
                         "cache.direct=on,cache.no-flush=on,discard=unmap,locking=off",
            "-device", f"virtio-blk-pci,drive={SCRATCH},id={SCRATCH},"
                       f"serial={SCRATCH_SERIAL},werror=report,rerror=report"]


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
        accel, cpu, present = "tcg,thread=multi,tb-size=32", TCG_CPU, maxcpus
        append += f" maxcpus={s.vcpus}"
    else:
        accel, cpu, present = "kvm", "host", s.vcpus
    return [
        q.path, "-name", f"podvm-{s.sandbox_id},debug-threads=on",
        "-machine", f"q35,memory-backend={RAM}", "-accel", accel, "-cpu", cpu,
        "-bios", qboot(q.path), "-nodefaults", "-nographic", "-no-user-config", "-no-reboot",
        "-S",  # paused until QMP is attached, so no early event is missed
        "-smp", f"{present},maxcpus={maxcpus}",
        "-m", f"{s.memory_mib}M,slots=8,maxmem={maxmem}M",
        *_ram(s),
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
        *_share(s),
        *_scratch(s),
        "-pidfile", os.path.join(s.workdir, "qemu.pid"),
        *(["-sandbox", q.seccompsandbox] if q.seccompsandbox else []),
        *(arg for nic in s.nics
          for arg in nic.qemu_args(mac=template_mac(nic.index) if s.template else "")),
    ]
