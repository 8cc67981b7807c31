"""Undoing what podvm did in a pod's namespace, from its path alone (so `delete` can after
a crash): podvm's taps are removed, and the ingress qdisc (with its filters) of every
interface that holds podvm's redirect. The namespace and CNI's interfaces are left to
containerd."""
from __future__ import annotations

import contextlib
import errno
from typing import Iterable, Iterator

from pyroute2 import AsyncIPRoute, NetlinkError

from . import tc
from .errors import NamespaceGone, NetworkError
from .netns import rtnl, step
from .tap import is_podvm_tap

GONE = {errno.ENODEV, errno.ENOENT, errno.EINVAL}
"""What the kernel answers for a device or qdisc that is not (or no longer) there."""


async def detach(netns: str, taps: Iterable[str] = ()) -> None:
    """Remove podvm's taps (tun devices named like podvm's, and `taps`: the names the
    caller persisted) and redirects. Idempotent; a namespace already gone is nothing to do.
    Everything is tried; the first failure is raised after (NetworkError)."""
    extra = set(taps)
    failures: list[NetworkError] = []
    try:
        async with rtnl(netns) as ipr:
            with step(netns, "list interfaces"):
                links = [msg async for msg in await ipr.link("dump")]
            taps_found = [msg for msg in links if _is_podvm_tap(msg, extra)]
            tap_indexes = {msg["index"] for msg in taps_found}
            for msg in links:  # first the redirects, so none points to a tap being removed
                if msg["index"] not in tap_indexes:
                    with _noted(failures), step(netns, "remove podvm's redirect",
                                                msg.get("IFLA_IFNAME")):
                        if await tc.has_podvm_redirect(ipr, msg["index"]):
                            await ignoring_gone(tc.remove_ingress(ipr, msg["index"]))
            for msg in taps_found:
                with _noted(failures), step(netns, "remove the tap", msg.get("IFLA_IFNAME")):
                    await remove_link(ipr, msg["index"])
    except NamespaceGone:
        return
    if failures:
        raise failures[0]


@contextlib.contextmanager
def _noted(failures: list[NetworkError]) -> Iterator[None]:
    try:
        yield
    except NetworkError as exc:
        failures.append(exc)


def _is_podvm_tap(link, extra: set[str]) -> bool:
    """A tun device with podvm's name (never a CNI interface, whatever a caller passes)."""
    name = link.get("IFLA_IFNAME")
    return (link.get(("IFLA_LINKINFO", "IFLA_INFO_KIND")) == "tun"
            and (is_podvm_tap(name) or name in extra))


async def remove_link(ipr: AsyncIPRoute, index: int) -> None:
    await ignoring_gone(ipr.link("del", index=index))


async def ignoring_gone(request) -> None:
    """Await a removal; one whose object is already gone has done its job."""
    try:
        await request
    except NetlinkError as exc:
        if exc.code not in GONE:
            raise
