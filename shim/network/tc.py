"""Traffic-control redirection between an interface and its tap, both ways ("tcfilter",
Kata's default model): every frame arriving on one leaves by the other, untouched, so the
guest owns the interface's MAC and addresses.

On each device: an ingress qdisc and one u32 filter that matches every frame (one key,
value and mask 0; terminal) with a mirred egress redirect to the other device. The
filter's priority marks it as podvm's, so that cleanup finds it from the namespace alone."""
from __future__ import annotations

from pyroute2 import AsyncIPRoute

INGRESS = 0xFFFF0000
"""ffff: the ingress qdisc's handle, the filters' parent."""
ETH_P_ALL = 0x0003
FILTER_PRIO = 0x7064
"""'pd': podvm's redirect (a priority that CNI plugins and tc users do not pick)."""


async def has_ingress(ipr: AsyncIPRoute, index: int) -> bool:
    """Whether the device has an ingress (or clsact) qdisc: both take handle ffff:."""
    qdiscs = [msg async for msg in await ipr.get_qdiscs(index)]
    return any(msg["index"] == index and msg["handle"] == INGRESS for msg in qdiscs)


async def add_ingress(ipr: AsyncIPRoute, index: int) -> None:
    await ipr.tc("add", "ingress", index, "ffff:")


async def remove_ingress(ipr: AsyncIPRoute, index: int) -> None:
    """Remove the ingress qdisc and its filters (there must be one)."""
    await ipr.tc("del", "ingress", index, "ffff:")


async def add_redirect(ipr: AsyncIPRoute, index: int, to_index: int) -> None:
    """Frames arriving on `index` leave by `to_index` (its ingress qdisc must exist)."""
    await ipr.tc("add-filter", "u32", index, parent=INGRESS, prio=FILTER_PRIO,
                 protocol=ETH_P_ALL, keys=["0x0/0x0+0"], target=0,
                 action={"kind": "mirred", "direction": "egress", "action": "redirect",
                         "ifindex": to_index})


async def has_podvm_redirect(ipr: AsyncIPRoute, index: int) -> bool:
    """Whether the device's ingress holds podvm's filter (whatever device it redirects
    to: after a crash the tap may be gone)."""
    if not await has_ingress(ipr, index):
        return False
    filters = [msg async for msg in await ipr.get_filters(index, parent=INGRESS)]
    return any(msg["info"] >> 16 == FILTER_PRIO and msg.get("TCA_KIND") == "u32"
               for msg in filters)

