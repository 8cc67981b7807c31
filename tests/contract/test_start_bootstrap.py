"""`start`'s answer on stdout: containerd 2.3 writes BootstrapParams to its stdin and parses
stdout as a BootstrapResult (protobuf) first, taking a bare address only as a legacy shim's
fallback (core/runtime/v2/shim.go, parseStartResponse, in containerd); 1.6 to 2.2 write the
runtime's options alone (an Any) or nothing, and read a bare address. The hand-made wire
format of shim/contract/bootstrap.py is checked against the generated messages."""
from __future__ import annotations

import pathlib

import pytest
from google.protobuf.any_pb2 import Any

from podvm_core.pb.containerd.runtime.bootstrap.v1.bootstrap_pb2 import (
    BootstrapParams, BootstrapResult, Extension, LogLevel)
from podvm_core.pb.containerd.runtimeoptions.v1.api_pb2 import Options
from shim.contract import bootstrap
from shim.host.paths import RUNTIME_OPTIONS_FILE
from testbed.shimproc import make_bundle, run_shim

ADDRESS = "unix:///run/containerd/s/" + "ab" * 32
OPTIONS = Any(type_url="containerd.runtimeoptions.v1.Options",
              value=Options(config_path="/etc/podvm/configuration.toml").SerializeToString())


def params(grpc_address: str = "/run/containerd/containerd.sock", options: bool = True,
           **fields) -> bytes:
    """What containerd 2.3's pkg/shim/util.go (Command) writes to `start`'s stdin."""
    message = BootstrapParams(instance_id="sb1", namespace="k8s.io",
                              containerd_version="v2.3.4",
                              containerd_grpc_address=grpc_address,
                              containerd_ttrpc_address=grpc_address + ".ttrpc",
                              containerd_binary="/usr/local/bin/containerd", **fields)
    if options:
        message.extensions.append(Extension(value=OPTIONS))
    return message.SerializeToString()


@pytest.mark.parametrize("address", [ADDRESS, "unix:///x", "vsock://3:1024", "u" * 300])
def test_the_result_is_containerd_s_bootstrap_result(address) -> None:
    data = bootstrap.result(address)
    assert data == BootstrapResult(version=2, address=address,
                                   protocol="ttrpc").SerializeToString()
    assert bootstrap.answer(params(), address) == data


@pytest.mark.parametrize("stdin", [
    params(), params(options=False), params(log_level=LogLevel.LOG_LEVEL_DEBUG),
    params(socket_dir="/run/c/s"), BootstrapParams(containerd_version="v2.4.0")
    .SerializeToString()])
def test_bootstrap_params_are_recognised(stdin) -> None:
    assert bootstrap.sent_params(stdin)


@pytest.mark.parametrize("stdin", [
    b"", OPTIONS.SerializeToString(), Any(type_url="x").SerializeToString(),
    ADDRESS.encode(), b"\x0a\x05ab", b"\x0a\xff", b"\x0b\x0c", b"\xff", params()[:-1]])
def test_the_options_alone_nothing_or_no_protobuf_get_the_bare_address(stdin) -> None:
    assert not bootstrap.sent_params(stdin)
    assert bootstrap.answer(stdin, ADDRESS) == ADDRESS.encode()


def test_start_answers_containerd_2_3_with_a_bootstrap_result(tmp_path: pathlib.Path
                                                              ) -> None:
    """The real binary, as containerd 2.3.4 runs it; a second container of the pod (its
    daemon already there) gets the same answer."""
    grpc = str(tmp_path / "containerd.sock")
    sandbox = make_bundle(tmp_path, "sb1", sandbox_id="sb1")
    workload = make_bundle(tmp_path, "c1", sandbox_id="sb1")
    try:
        answers = [run_shim(bundle, name, "start", grpc, stdin=params(grpc))
                   for bundle, name in ((sandbox, "sb1"), (workload, "c1"))]
        for bundle, started in zip((sandbox, workload), answers):
            assert started.returncode == 0, started.stderr
            result = BootstrapResult.FromString(started.stdout)
            address = (bundle / "address").read_text()
            assert (result.version, result.address, result.protocol) == (2, address, "ttrpc")
            assert started.stdout == bootstrap.result(address)
            assert (bundle / RUNTIME_OPTIONS_FILE).read_bytes() == params(grpc)
    finally:
        run_shim(sandbox, "sb1", "delete", grpc)


@pytest.mark.parametrize("stdin", [None, OPTIONS.SerializeToString()])
def test_start_answers_containerd_before_2_3_with_the_bare_address(tmp_path, stdin) -> None:
    grpc = str(tmp_path / "containerd.sock")
    bundle = make_bundle(tmp_path, "sb1", sandbox_id="sb1")
    try:
        started = run_shim(bundle, "sb1", "start", grpc, stdin=stdin)
        assert started.returncode == 0, started.stderr
        assert started.stdout.decode() == (bundle / "address").read_text()
        assert started.stdout.startswith(b"unix:///run/containerd/s/")
    finally:
        run_shim(bundle, "sb1", "delete", grpc)
