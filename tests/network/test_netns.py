"""The shim's thread enters a pod's namespace only for an instant and always comes back;
other threads of the process never leave their own."""
from __future__ import annotations

import os
import threading

import pytest

from shim.network.enter import made_inside
from shim.network.read import read_network
from tests.network.conftest import Namespace


def own_netns() -> int:
    return os.stat("/proc/thread-self/ns/net").st_ino


async def test_the_thread_comes_back_even_when_the_work_inside_fails(pod: Namespace) -> None:
    before = own_netns()
    assert made_inside(pod.path, own_netns) == os.stat(pod.path).st_ino
    assert own_netns() == before

    def fail() -> None:
        raise ValueError("inside")

    with pytest.raises(ValueError, match="inside"):
        made_inside(pod.path, fail)
    assert own_netns() == before


async def test_other_threads_stay_where_they_are(pod: Namespace) -> None:
    host = own_netns()
    seen: set[int] = set()
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            seen.add(own_netns())

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        for _ in range(50):
            await read_network(pod.path)
    finally:
        stop.set()
        watcher.join(timeout=10)
    assert seen == {host}
    assert own_netns() == host
