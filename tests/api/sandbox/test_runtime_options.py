"""The Sandbox API honours containerd's runtime options (issue 27): with the "shim"
sandboxer containerd gives them only to `start`, on its stdin, and CreateSandbox loads the
configuration their ConfigPath names, over $PODVM_CONFIG and the system file, as a Task-API
Create does. Options that are not podvm's, or not protobuf at all, are refused by name at
CreateSandbox, which then leaves nothing made."""
from __future__ import annotations

import pathlib

import pytest
from google.protobuf.any_pb2 import Any
from google.protobuf.wrappers_pb2 import BytesValue

from podvm_core.pb.containerd.runtime.sandbox.v1 import sandbox_pb2 as sb
from podvm_core.pb.containerd.runtimeoptions.v1.api_pb2 import Options
from podvm_core.pb.cri import api_pb2 as cri
from podvm_core.ttrpc import Code, TtrpcError
from shim.api.options import RUNTIME_OPTIONS, load_config, saved_options
from shim.host.paths import RUNTIME_OPTIONS_FILE
from testbed.vmconfig import vmm_config, write_test_config

from tests.api.sandbox.harness import MIB, sandbox_shim


def private_config(tmp_path: pathlib.Path, **qemu: object) -> pathlib.Path:
    """At a path of its own, neither $PODVM_CONFIG's nor the system file."""
    (tmp_path / "private").mkdir()
    return write_test_config(tmp_path / "private" / "podvm.toml", **qemu)


def runtime_options(config_path: str) -> bytes:
    """As containerd marshals them for `start` (runtimeoptions.v1.Options in an Any)."""
    options = Any()
    options.Pack(Options(config_path=config_path))
    return options.SerializeToString()


def bootstrap(*extensions: bytes) -> bytes:
    """containerd 2.3's BootstrapParams, as it marshals it for `start`: instance id,
    namespace, version, ttrpc address, then each Any wrapped in an Extension."""
    params = Any(type_url="sbapi-id", value=b"k8s.io").SerializeToString()
    for number, text in ((4, b"2.3.4"), (5, b"/run/containerd/containerd.sock.ttrpc")):
        params += _length_delimited(number, text)
    for extension in extensions:
        params += _length_delimited(8, BytesValue(value=extension).SerializeToString())
    return params


def _length_delimited(number: int, data: bytes) -> bytes:
    out, size = bytes([number << 3 | 2]), len(data)
    while size >= 0x80:
        out, size = out + bytes([size & 0x7F | 0x80]), size >> 7
    return out + bytes([size]) + data


def not_podvms() -> bytes:
    options = Any()
    options.Pack(cri.PodSandboxConfig())
    return options.SerializeToString()


# --- what CreateSandbox reads from the bundle ---------------------------------------------

def test_no_kept_options_is_the_default_configuration(tmp_path) -> None:
    assert saved_options(str(tmp_path)) is None
    assert saved_options("") is None


@pytest.mark.parametrize("containerd", ["2.2", "2.3"])
def test_kept_options_name_the_configuration(tmp_path, containerd) -> None:
    config = write_test_config(tmp_path / "private.toml", default_memory=320)
    options = runtime_options(str(config))
    (tmp_path / RUNTIME_OPTIONS_FILE).write_bytes(
        options if containerd == "2.2" else bootstrap(not_podvms(), options))
    assert load_config(saved_options(str(tmp_path))).qemu.default_memory == 320


def test_bootstrap_params_without_options_is_the_default_configuration(tmp_path) -> None:
    (tmp_path / RUNTIME_OPTIONS_FILE).write_bytes(bootstrap(not_podvms()))
    assert saved_options(str(tmp_path)) is None


@pytest.mark.parametrize("data, said", [(not_podvms(), "runtime.v1.PodSandboxConfig"),
                                        (b"\xff\xff\xff garbage", "runtime options"),
                                        (Any(type_url=f"x/{RUNTIME_OPTIONS}", value=b"\xff"
                                             ).SerializeToString(), RUNTIME_OPTIONS)])
def test_bad_kept_options_are_refused_by_name(tmp_path, data, said) -> None:
    (tmp_path / RUNTIME_OPTIONS_FILE).write_bytes(data)
    with pytest.raises(TtrpcError) as err:
        saved_options(str(tmp_path))
    assert err.value.code == Code.INVALID_ARGUMENT
    assert said in err.value.message and str(tmp_path / RUNTIME_OPTIONS_FILE) in err.value.message


# --- over ttrpc, `start` given them as containerd gives them --------------------------------

@pytest.mark.parametrize("containerd", ["2.2", "2.3"])
async def test_the_options_config_path_wins_over_podvm_config(tmp_path, containerd) -> None:
    """$PODVM_CONFIG (the harness's) names a good configuration; the options one whose
    kernel is missing: the pod fails naming that kernel, not /etc/podvm."""
    missing = tmp_path / "no-such-vmlinux"
    private = private_config(tmp_path)
    private.write_text(private.read_text().replace(
        "kernel = ", f'kernel = "{missing}"\n#kernel = ', 1))
    options = runtime_options(str(private))
    async with sandbox_shim(tmp_path, runtime_options=options if containerd == "2.2"
                            else bootstrap(options)) as pod:
        assert (pod.bundle / RUNTIME_OPTIONS_FILE).exists()
        with pytest.raises(TtrpcError) as err:
            await pod.create(pod.config(memory=64 * MIB))
            await pod.call("StartSandbox", sb.StartSandboxRequest(sandbox_id=pod.id),
                           sb.StartSandboxResponse)
        assert str(missing) in err.value.message, err.value.message
        assert "/etc/podvm" not in err.value.message


@pytest.mark.parametrize("data", [not_podvms(), b"\xff\xff\xff garbage"])
async def test_bad_options_refuse_the_sandbox_and_make_nothing(tmp_path, data) -> None:
    async with sandbox_shim(tmp_path, runtime_options=data) as pod:
        with pytest.raises(TtrpcError) as err:
            await pod.create(pod.config(memory=64 * MIB))
        assert err.value.code == Code.INVALID_ARGUMENT
        assert "runtime options" in err.value.message
        with pytest.raises(TtrpcError) as gone:
            await pod.status()
        assert gone.value.code == Code.NOT_FOUND


async def test_a_private_configuration_boots_the_pod(tmp_path) -> None:
    """No $PODVM_CONFIG and no system file: only the options name a configuration that
    can boot; its default_memory shows in the plan. Which configuration the shim loads
    is the host's business: the pod boots a FakeVM (testbed/fakevm.py)."""
    private = private_config(tmp_path, default_memory=288, boot_timeout=90,
                             **vmm_config("fake"))
    async with sandbox_shim(tmp_path, runtime_options=bootstrap(runtime_options(str(private))),
                            env_config=False, vmm="fake") as pod:
        await pod.create(pod.config(memory=64 * MIB))
        await pod.call("StartSandbox", sb.StartSandboxRequest(sandbox_id=pod.id),
                       sb.StartSandboxResponse)
        ready = await pod.status()
        assert ready.state == "SANDBOX_READY"
        assert '"memory_mib": 352' in ready.info["plan"]  # 288 + the pod's 64
        await pod.call("ShutdownSandbox", sb.ShutdownSandboxRequest(sandbox_id=pod.id),
                       sb.ShutdownSandboxResponse)


def test_corrupt_task_api_options_are_refused_by_name() -> None:
    """The same options in a Task-API Create: a value that does not decode is a clear
    INVALID_ARGUMENT, not a failure without a code."""
    options = Any(type_url=f"type.googleapis.com/containerd.{RUNTIME_OPTIONS}",
                  value=b"\x0a\xff\xff")
    with pytest.raises(TtrpcError) as caught:
        load_config(options)
    assert caught.value.code == Code.INVALID_ARGUMENT
    assert "runtime options" in caught.value.message
