"""A guest restored from a template made this pod's (the shim's ResumeRequest): every pod
restored from one template wakes with the template's memory, so what must differ between
pods, or follow the host, is set here before anything else runs: the clock, the kernel's
random state, the NICs' MACs; and the pod's share, which a template never mounts (over
virtio-fs its device is not even in the template: the restored VM has it, unseen by the
guest until a rescan of the PCI bus finds it). The share is mounted by mount(2) itself:
a process spawned here (mount -a) took a third of the resume under TCG.

Loaded with the agent (guest/agent/service.py), libc.py with it: a template holds them,
so a restored guest imports nothing on this path."""
from __future__ import annotations

import fcntl
import logging
import os
import time

from podvm_core.pb.agent import agent_pb2 as pb
from podvm_core.ttrpc import Code, TtrpcError

from . import libc, network
from .rtnetlink import LinkSet, Netlink

log = logging.getLogger("podvm.agent")

RNDRESEEDCRNG = 0x5207  # _IO('R', 0x07): reseed the CRNG from the input pool now
FSTAB = "/etc/podvm-fstab"
SHARE = "/run/podvm/shared"
SHARE_PARAM = "podvm_share="  # the share's file system type, on the kernel line
PCI_RESCAN = "/sys/bus/pci/rescan"
MIN_ENTROPY = 32


async def resume(req: pb.ResumeRequest) -> None:
    """INVALID_ARGUMENT for a request that cannot be applied as given (nothing is changed
    then); FAILED_PRECONDITION when the guest refuses a step (the pod cannot run)."""
    if len(req.entropy) < MIN_ENTROPY:
        raise TtrpcError(Code.INVALID_ARGUMENT, f"entropy: {len(req.entropy)} bytes, "
                         f"at least {MIN_ENTROPY} are needed to reseed the guest's CRNG")
    if req.realtime_unix_nanos <= 0:
        raise TtrpcError(Code.INVALID_ARGUMENT, "realtime_unix_nanos must be positive")
    started = time.monotonic()
    renames = _mac_renames(req.macs, network.links())
    time.clock_settime_ns(time.CLOCK_REALTIME, req.realtime_unix_nanos)
    _reseed(req.entropy)
    with Netlink() as netlink:
        for device, mac in renames:
            try:
                netlink.apply(LinkSet(device, address=mac))
            except OSError as exc:
                raise TtrpcError(Code.FAILED_PRECONDITION,
                                 f"ip link set dev {device} address {mac}: {exc}") from None
    set_up = time.monotonic()
    rescan = _mount_share()
    done = time.monotonic()
    log.info("resumed from a template in %.3fs: clock set, CRNG reseeded, %d MACs (%.3fs), "
             "share found (%.3fs) and mounted (%.3fs)", done - started, len(renames),
             set_up - started, rescan - set_up, done - rescan)


def _mac_renames(macs, links: dict[str, str]) -> list[tuple[str, str]]:
    """(device, new MAC) for each change; INVALID_ARGUMENT when a template MAC is none of
    the guest's devices."""
    by_mac = {mac: name for name, mac in links.items()}
    out = []
    for change in macs:
        device = by_mac.get(change.template_mac.lower())
        if device is None:
            raise TtrpcError(Code.INVALID_ARGUMENT, (
                f"no guest device has the template's MAC {change.template_mac} (the "
                f"guest has {', '.join(f'{n} {m}' for n, m in links.items()) or 'none'})"))
        out.append((device, change.mac.lower()))
    return out


def _reseed(entropy: bytes) -> None:
    """Mixed into the input pool (a write credits nothing, which is right: the CRNG is
    already initialized), then the CRNG takes a new key from the pool, as the kernel does
    itself when a VM generation ID changes."""
    fd = os.open("/dev/urandom", os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, entropy)
        fcntl.ioctl(fd, RNDRESEEDCRNG)
    finally:
        os.close(fd)


def share_type() -> str:
    with open("/proc/cmdline") as f:
        words = f.read().split()
    return next((w[len(SHARE_PARAM):] for w in words if w.startswith(SHARE_PARAM)), "9p")


def share_entry(fstype: str) -> tuple[str, str]:
    """The source and mount(2) data of the share's line of `fstype` in the guest's fstab
    (its options are the file system's own: "defaults" is none)."""
    with open(FSTAB) as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 4 and not fields[0].startswith("#") and \
                    fields[1] == SHARE and fields[2] == fstype:
                return fields[0], "" if fields[3] == "defaults" else fields[3]
    raise TtrpcError(Code.FAILED_PRECONDITION, f"{FSTAB} has no {fstype} line for {SHARE}")


def _mount_share() -> float:
    """When the share's device was found (time.monotonic())."""
    if os.path.ismount(SHARE):
        return time.monotonic()
    fstype = share_type()
    if fstype == "virtiofs":  # probed as the rescan adds it: mountable when this returns
        with open(PCI_RESCAN, "w") as f:
            f.write("1")
    found = time.monotonic()
    source, data = share_entry(fstype)
    try:
        libc.mount(source, SHARE, fstype, 0, data)
    except OSError as exc:
        raise TtrpcError(Code.FAILED_PRECONDITION, f"mount of the pod's share ({fstype} "
                         f"{source}) at {SHARE} failed: {exc.strerror}") from None
    return found
