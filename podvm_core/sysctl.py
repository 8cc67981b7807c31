"""Sysctl names as Kubernetes writes them and the /proc/sys file each one names, for the
shim (which judges a pod's sysctls) and the agent (which writes them) alike.

A name separates its parts with dots, and a part that holds a dot itself (a VLAN
interface, eth0.100) writes it as a slash: `net.ipv4.conf.eth0/100.forwarding`. The
slash form `net/ipv4/conf/eth0.100/forwarding` names the same file; kubelet turns it
into the dotted one, and so does `dotted` here."""
from __future__ import annotations

PROC_SYS = "/proc/sys"
_SWAP = str.maketrans("./", "/.")


def dotted(name: str) -> str:
    """The dotted form: a name whose first separator is a slash is in the slash form,
    whose dots and slashes swap."""
    for char in name:
        if char in "./":
            return name.translate(_SWAP) if char == "/" else name
    return name


def proc_path(name: str) -> str:
    """The file below /proc/sys that `name` (either form) sets; ValueError, saying why,
    for a name that cannot be one."""
    if not name or any(c.isspace() or c in "=\0" for c in name):
        raise ValueError(f"sysctl name {name!r} is empty or holds a space, '=' or NUL")
    relative = dotted(name).translate(_SWAP)
    if any(part in ("", ".", "..") for part in relative.split("/")):
        raise ValueError(f"sysctl name {name!r} has an empty, '.' or '..' part")
    return f"{PROC_SYS}/{relative}"
