"""Bridging a pod's interfaces into its VM: per interface, inside the pod's namespace, a
tap with the interface's MTU, tc redirection both ways (`tc.py`), the tap's descriptor
and a vhost-net one for QEMU. All or nothing: a failure undoes what was done, in reverse,
before the NetworkError is raised."""
from __future__ import annotations

import os
from typing import Awaitable, Callable

from pyroute2 import AsyncIPRoute

from . import tc
from .detach import ignoring_gone, remove_link
from .errors import NetworkError
from .model import Interface, PodNetwork, TapNic
from .netns import rtnl, step
from .tap import open_tap, open_vhost, tap_name


async def attach(network: PodNetwork) -> tuple[TapNic, ...]:
    """One TapNic per interface of `network` (as `read_network` found it), in order.
    The caller owns their descriptors (TapNic.close()) and removes the rest with
    `detach(network.netns, taps)`."""
    netns = network.netns
    undo: list[Callable[[], Awaitable[None]]] = []
    async with rtnl(netns) as ipr:
        try:
            return tuple([await _attach(ipr, netns, index, itf, undo)
                          for index, itf in enumerate(network.interfaces)])
        except BaseException:
            for action in reversed(undo):
                try:
                    await action()
                except Exception:  # best effort: the first error is the one to report
                    pass
            raise


async def _attach(ipr: AsyncIPRoute, netns: str, index: int, itf: Interface,
                  undo: list[Callable[[], Awaitable[None]]]) -> TapNic:
    name = tap_name(index)
    with step(netns, "find the interface", itf.name):
        itf_index = await _lookup(ipr, itf.name)
        if itf_index is None:
            raise NetworkError(netns, "find the interface", "no such interface", itf.name)
        if await tc.has_ingress(ipr, itf_index):
            raise NetworkError(netns, "find the interface", "it already has an ingress "
                               "qdisc (another tool's traffic control), which podvm's "
                               "redirect would replace", itf.name)
    with step(netns, f"create the tap {name}", itf.name):
        if await _lookup(ipr, name) is not None:
            raise NetworkError(netns, f"create the tap {name}", "it already exists (a "
                               "previous attach was not detached)", itf.name)
        tap_fd = open_tap(netns, name)
        undo.append(lambda: _remove_tap(ipr, name, tap_fd))
        tap_index = await _lookup(ipr, name)
        if tap_index is None:
            raise NetworkError(netns, f"create the tap {name}", "the kernel made no such "
                               "device", itf.name)
    with step(netns, f"set the MTU of {name} to {itf.mtu} and bring it up", itf.name):
        await ipr.link("set", index=tap_index, mtu=itf.mtu, state="up")
    with step(netns, f"add ingress qdiscs to {itf.name} and {name}", itf.name):
        undo.append(lambda: ignoring_gone(tc.remove_ingress(ipr, itf_index)))
        await tc.add_ingress(ipr, itf_index)  # (undone even if cancelled while it runs)
        await tc.add_ingress(ipr, tap_index)
    with step(netns, f"redirect {itf.name} to {name} and back", itf.name):
        await tc.add_redirect(ipr, itf_index, tap_index)
        await tc.add_redirect(ipr, tap_index, itf_index)
    with step(netns, "open /dev/vhost-net", itf.name):
        vhost_fd = open_vhost()
    if vhost_fd is not None:
        undo.append(lambda: _close(vhost_fd))
    return TapNic(index=index, interface=itf.name, tap=name, mac=itf.mac, mtu=itf.mtu,
                  tap_fd=tap_fd, vhost_fd=vhost_fd)


async def _lookup(ipr: AsyncIPRoute, name: str) -> int | None:
    found = await ipr.link_lookup(ifname=name)
    return found[0] if found else None


async def _remove_tap(ipr: AsyncIPRoute, name: str, fd: int) -> None:
    """Closing the last descriptor removes a tap; it is removed by name too, in case
    someone else holds one."""
    os.close(fd)
    index = await _lookup(ipr, name)
    if index is not None:
        await remove_link(ipr, index)


async def _close(fd: int) -> None:
    os.close(fd)
