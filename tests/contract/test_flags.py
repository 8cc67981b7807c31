from __future__ import annotations

import pytest

from shim.contract.flags import UsageError, parse


def test_containerd_start_command_line() -> None:
    flags = parse(["-namespace", "k8s.io", "-address", "/run/containerd/containerd.sock",
                   "-publish-binary", "/usr/bin/containerd", "-id", "abc", "-debug", "start"])
    assert (flags.namespace, flags.id, flags.action, flags.debug) == ("k8s.io", "abc", "start",
                                                                     True)
    assert flags.publish_binary == "/usr/bin/containerd"


def test_go_flag_spellings() -> None:
    flags = parse(["--namespace=ns", "-id=x", "-bundle", "/b", "-debug=false", "delete"])
    assert (flags.namespace, flags.id, flags.bundle, flags.debug, flags.action) == \
        ("ns", "x", "/b", False, "delete")
    assert parse([]).action == "serve"
    assert parse(["-v"]).version and parse(["--version"]).version
    assert parse(["-h"]).help


@pytest.mark.parametrize("argv, message", [
    (["-nope"], "not defined: -nope"),
    (["-id"], "needs an argument: -id"),
    (["frobnicate"], "unknown subcommand"),
    (["start", "extra"], "unexpected arguments"),
])
def test_bad_command_lines_say_what_is_wrong(argv, message) -> None:
    with pytest.raises(UsageError, match=message):
        parse(argv)
