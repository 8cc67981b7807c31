"""Pieces of the crictl-compatible client that need no containerd: its configuration
file, flags, durations, CRI log format, tables and endpoints (the commands themselves are
exercised against a real containerd in test_crictl.py)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from testbed import crictl as cli
from testbed import crictlformat as fmt
from testbed import crictlsettings as cfg
from testbed import crictlstreams as streams
from testbed.containerd import REPO_ROOT
from testbed.criclient import grpc_target


def test_read_config_takes_crictl_yaml(tmp_path) -> None:
    path = tmp_path / "crictl.yaml"
    path.write_text("---\n# comment\nruntime-endpoint: unix:///run/x.sock  # trailing\n"
                    "image-endpoint: 'unix:///run/y.sock'\ntimeout: 10\ndebug: true\n")
    assert cfg.read_config(str(path)) == {"runtime-endpoint": "unix:///run/x.sock",
                                          "image-endpoint": "unix:///run/y.sock",
                                          "timeout": "10", "debug": "true"}


def test_global_and_command_timeouts_apart() -> None:
    args = cli.build_parser().parse_args(["-t", "30s", "stop", "-t", "0", "x"])
    assert (args.global_timeout, args.timeout, args.ids) == ("30s", 0, ["x"])
    args = cli.build_parser().parse_args(["exec", "-s", "x", "sh", "-c", "exit 3"])
    assert (args.container, args.cmd, args.global_timeout) == ("x", ["sh", "-c", "exit 3"],
                                                                 None)


def test_durations() -> None:
    assert cfg.parse_duration("2s") == 2
    assert cfg.parse_duration("1m30s") == 90
    assert cfg.parse_duration("500ms") == 0.5
    assert cfg.parse_duration("10") == 10
    with pytest.raises(fmt.Fatal):
        cfg.parse_duration("2 s")


def test_cri_log_format() -> None:
    data = (b"2024-01-01T00:00:00.1Z stdout F one\n"
            b"2024-01-01T00:00:00.2Z stderr F two\n"
            b"2024-01-01T00:00:00.3Z stdout P thr\n"
            b"2024-01-01T00:00:00.4Z stdout F ee\n"
            b"2024-01-01T00:00:00.5Z stdout F \n"
            b"2024-01-01T00:00:00.6Z stdout P tail")
    assert streams._log_records(data) == [
        ("2024-01-01T00:00:00.1Z", "stdout", b"one\n"),
        ("2024-01-01T00:00:00.2Z", "stderr", b"two\n"),
        ("2024-01-01T00:00:00.3Z", "stdout", b"three\n"),
        ("2024-01-01T00:00:00.5Z", "stdout", b"\n"),
        ("2024-01-01T00:00:00.6Z", "stdout", b"tail")]


def test_tables_and_units() -> None:
    assert fmt.table(["A", "B"], [["x" * 25, "y"]]) == \
        "A" + " " * 27 + "B\n" + "x" * 25 + "   y\n"
    assert fmt.human_duration(0.5) == "Less than a second"
    assert fmt.human_duration(75) == "About a minute"
    assert fmt.human_duration(3 * 3600) == "3 hours"
    assert fmt.human_size(2_131_000) == "2.131MB"
    assert fmt.truncate_id("sha256:" + "ab" * 32, "sha256:") == "ab" * 6 + "a"


def test_endpoints() -> None:
    assert grpc_target("unix:///run/containerd/containerd.sock") == \
        "unix:///run/containerd/containerd.sock"
    assert grpc_target("/run/x.sock") == "unix:///run/x.sock"
    assert grpc_target("tcp://127.0.0.1:1234") == "127.0.0.1:1234"


def test_cri_messages_need_no_grpc() -> None:
    """shim/ never imports grpc: the generated CRI messages must not pull it in."""
    code = "import sys, podvm_core.pb.cri.api_pb2 as m; print('grpc' in sys.modules, " \
           "[s.full_name for s in m.DESCRIPTOR.services_by_name.values()])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=REPO_ROOT, check=True).stdout
    assert out.strip() == "False ['runtime.v1.RuntimeService', 'runtime.v1.ImageService']"


def test_json_configs_in_either_spelling(tmp_path) -> None:
    from podvm_core.pb.cri import api_pb2

    path = tmp_path / "pod.json"
    path.write_text(json.dumps({"metadata": {"name": "p"}, "logDirectory": "/l",
                                "linux": {"security_context": {"namespaceOptions":
                                                               {"network": "NODE"}}},
                                "unknown_field": 1}))
    msg = fmt.load_message(str(path), api_pb2.PodSandboxConfig())
    assert msg.log_directory == "/l"
    assert msg.linux.security_context.namespace_options.network == api_pb2.NODE


def test_inspectp_prints_the_pod_network_as_crictl_does() -> None:
    from podvm_core.pb.cri import api_pb2

    status = api_pb2.PodSandboxStatus(id="p", network=api_pb2.PodSandboxNetworkStatus(
        ip="10.1.2.3", additional_ips=[api_pb2.PodIP(ip="fd00::3")]))
    out = json.loads(fmt.status_info(status, {"info": '{"pid": 1}'}))
    assert out["status"]["network"] == {"ip": "10.1.2.3",
                                        "additionalIps": [{"ip": "fd00::3"}]}
    assert out["info"] == {"pid": 1}


@pytest.mark.parametrize("argv", [
    ["--help"],
    ["bogus"],
    ["-r", "unix:///nonexistent/cri.sock", "--timeout", "1s", "version"],
    ["-r", "unix:///nonexistent/cri.sock", "exec", "-s", "x"],
])
def test_a_command_run_in_the_tests_process_says_what_its_process_says(argv) -> None:
    """testbed/cri.py runs our crictl in the test's process (run_here): the same status,
    stdout and stderr as `python -m testbed.crictl`."""
    proc = subprocess.run([sys.executable, "-m", "testbed.crictl", *argv],
                          capture_output=True, cwd=REPO_ROOT)
    assert cli.run_here(argv) == (proc.returncode, proc.stdout, proc.stderr)


def test_commands_run_at_once_in_threads_keep_their_output_apart() -> None:
    """Tests start pods from threads (e2e/test_scale.py): each run's output is its own."""
    import threading

    got: dict[int, tuple[int, bytes, bytes]] = {}

    def run(n: int) -> None:
        got[n] = cli.run_here(["-r", f"unix:///nonexistent/{n}.sock", "--timeout", "1s",
                               "version"])

    threads = [threading.Thread(target=run, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for n, (status, out, err) in got.items():
        assert status == 1 and out == b"" and err.count(b"FATA") == 1, err
        assert f"/nonexistent/{n}.sock".encode() in err
