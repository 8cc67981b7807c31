"""The CRI harness every end-to-end test stands on, held to a known-good runtime: our
crictl-compatible client and the test containerd (Debian's 1.6) drive runc pods here, so
that a failure in tests/e2e/test_podvm_pods.py (pods in VMs) is podvm's and not the
harness's. The podvm test here proves the wiring only: containerd's CRI picks the packaged
podvm runtime section, starts our shim with the ConfigPath it names, relays the shim's
error and leaves nothing. Every test runs with the real crictl too: CRICTL=/path/to/crictl.
The client's own pieces (parsing, formats) are tested apart, in test_crictl_client.py.
"""
from __future__ import annotations

import os
import pathlib
import re
import subprocess
import time
import tomllib

import pytest

from shim.host import paths
from testbed.containerd import (CRI_NAMESPACE, PODVM_SNIPPET, REPO_ROOT, Containerd, cgroup_dirs,
                                mounts_under, podvm_runtime_section, shims_of)
from testbed.cri import Crictl, write_config
from testbed.pods import container_config, pod_config
from testbed.prereqs import require_root, require_tool

# Our podvm configuration for these tests: a QEMU that cannot exist, so the shim's answer
# names a path only this file has (proof that ConfigPath travelled from containerd's
# config to the shim) and no VM is started: pods in VMs are test_podvm_pods.py's.
BOGUS_QEMU = "/nonexistent/podvm-crictl-test/qemu-system-x86_64"


@pytest.fixture(scope="module")
def ctd(tmp_path_factory, image_cache):
    require_root()
    for tool in ("containerd", "ctr", "containerd-shim-runc-v2"):
        require_tool(tool, "containerd")
    require_tool("runc", "runc")
    require_tool("busybox", "busybox-static")
    workdir = tmp_path_factory.mktemp("cri")
    podvm_config = workdir / "podvm.toml"
    podvm_config.write_text(f'[hypervisor.qemu]\npath = "{BOGUS_QEMU}"\n')
    c = Containerd(workdir / "containerd", namespace="podvm-cri-test", cri=True,
                   podvm_config=podvm_config)
    c.start()
    try:
        c.import_cri_images(image_cache)
        yield c
    finally:
        c.stop()
    assert c.forced == [], f"stop() had to force: {c.forced}"
    assert shims_of(c.address) == []
    assert mounts_under(c.workdir) == []
    assert not c.state.exists() and not c.root.exists()
    assert cgroup_dirs(c.cgroup_parent.strip("/")) == []


@pytest.fixture(scope="module")
def crictl(ctd) -> Crictl:
    return Crictl(ctd.cri_endpoint)


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> pathlib.Path:
    return tmp_path_factory.mktemp("cri-configs")


def run_container(crictl: Crictl, configs: pathlib.Path, pod_id: str, pod_file: pathlib.Path,
                  name: str, script: str) -> str:
    cfile = write_config(configs, f"{name}-container.json", container_config(name, script))
    cid = crictl.create(pod_id, cfile, pod_file)
    crictl.start(cid)
    return cid


def wait_for(what: str, check, timeout: float = 60):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.2)


def leftovers(ctd: Containerd, ids: list[str]) -> list[str]:
    """What a removed pod or container could leave: its shim, mounts, containerd's task and
    CRI state, runc's state, its cgroup."""
    found = [f"shim {pid}: {cmd}" for pid, cmd in shims_of(ctd.address)
             if any(i in cmd for i in ids)]
    found += [f"mount {m}" for m in mounts_under(ctd.workdir) if any(i in m for i in ids)]
    for where in (ctd.state / "io.containerd.runtime.v2.task" / CRI_NAMESPACE,
                  ctd.state / "io.containerd.grpc.v1.cri" / "sandboxes",
                  ctd.root / "io.containerd.grpc.v1.cri" / "sandboxes",
                  ctd.root / "io.containerd.grpc.v1.cri" / "containers",
                  ctd.state / "runc" / CRI_NAMESPACE):
        if where.is_dir():
            found += [f"state {where / n}" for n in os.listdir(where) if n in ids]
    for i in ids:
        found += [f"cgroup {d}" for d in cgroup_dirs(f"{ctd.cgroup_parent.strip('/')}/{i}")]
    return found


# ---- a pod of two busybox containers, shared by the tests below --------------------------

@pytest.fixture(scope="module")
def pod(ctd, crictl, configs):
    pod_file = write_config(configs, "pod-two.json", pod_config(ctd, configs, "two"))
    pod_id = crictl.runp(pod_file)
    try:
        ids = {name: run_container(crictl, configs, pod_id, pod_file, name,
                                   f"echo hello-from-{name}; sleep 1000")
               for name in ("a", "b")}
        yield {"id": pod_id, "file": pod_file, **ids}
    finally:
        crictl.run("stopp", pod_id, check=False)
        crictl.run("rmp", pod_id, check=False)


def test_both_containers_log(crictl, pod) -> None:
    for name in ("a", "b"):
        wait_for(f"{name}'s log", lambda: crictl.logs(pod[name]).stdout == f"hello-from-{name}\n")
    assert crictl.logs(pod["a"], tail=1).stdout == "hello-from-a\n"


def test_ps_and_pods_list_them(crictl, pod) -> None:
    assert sorted(crictl.ps("--pod", pod["id"])) == sorted([pod["a"], pod["b"]])
    assert pod["id"] in crictl.pods()
    table = crictl.run("ps", "--pod", pod["id"]).stdout.splitlines()
    assert table[0].split()[:3] == ["CONTAINER", "IMAGE", "CREATED"]
    assert {line.split()[0] for line in table[1:]} == {pod["a"][:13], pod["b"][:13]}
    assert all("Running" in line for line in table[1:])
    pods = crictl.run("pods").stdout
    assert re.search(rf"^{pod['id'][:13]}\s.*\bReady\s+two\s+podvm-test\s+0\s+\(default\)$",
                     pods, re.M), pods


def test_exec_returns_output_and_exit_code(crictl, pod) -> None:
    ok = crictl.exec(pod["a"], "echo", "hi")
    assert (ok.exit_code, ok.stdout) == (0, "hi\n")
    failed = crictl.exec(pod["b"], "sh", "-c", "echo out; echo err >&2; exit 3")
    assert failed.exit_code == 3
    assert "err" in failed.stderr
    if not crictl.binary:  # the real crictl drops stdout when the command fails
        assert (failed.raw.returncode, failed.stdout) == (3, "out\n")
    hostname = crictl.exec(pod["a"], "hostname")  # the pod's UTS namespace, named by it
    assert (hostname.exit_code, hostname.stdout) == (0, "two\n")


def test_inspect_and_inspectp(ctd, crictl, pod) -> None:
    c = crictl.inspect(pod["a"])
    assert c["status"]["id"] == pod["a"]
    assert c["status"]["state"] == "CONTAINER_RUNNING"
    assert c["status"]["metadata"]["name"] == "a"
    assert c["status"]["logPath"].endswith("/two/a.log")
    assert c["info"]["sandboxID"] == pod["id"]
    assert c["info"]["runtimeType"] == "io.containerd.runc.v2"
    spec = c["info"]["runtimeSpec"]
    assert spec["annotations"]["io.kubernetes.cri.container-type"] == "container"
    assert spec["linux"]["cgroupsPath"] == f"{ctd.cgroup_parent}/{pod['a']}"
    p = crictl.inspectp(pod["id"])
    assert p["status"]["state"] == "SANDBOX_READY"
    assert p["status"]["linux"]["namespaces"]["options"]["network"] == "POD"
    assert p["status"]["metadata"] == {"name": "two", "uid": "uid-two",
                                       "namespace": "podvm-test", "attempt": 0}


def test_stats(crictl, pod) -> None:
    stats = crictl.run("stats", "-o", "json").json()["stats"]
    by_id = {s["attributes"]["id"]: s for s in stats}
    assert {pod["a"], pod["b"]} <= set(by_id)
    assert int(by_id[pod["a"]]["memory"]["workingSetBytes"]["value"]) > 0
    table = crictl.run("stats", pod["a"]).stdout.splitlines()
    assert table[0].startswith("CONTAINER") and "CPU %" in table[0]
    assert [line.split()[0] for line in table[1:]] == [pod["a"][:13]]


def test_update_container_resources(ctd, crictl, pod) -> None:
    crictl.run("update", "--cpu-quota", "30000", "--cpu-period", "100000",
               "--memory", str(96 * 1024 * 1024), pod["b"])
    linux = crictl.inspect(pod["b"])["status"]["resources"]["linux"]
    assert linux["cpuQuota"] == "30000"
    assert linux["cpuPeriod"] == "100000"
    assert linux["memoryLimitInBytes"] == str(96 * 1024 * 1024)
    # ... and runc applied it to the container's cgroup (v1 or v2 files).
    files = {}
    for d in cgroup_dirs(f"{ctd.cgroup_parent.strip('/')}/{pod['b']}"):
        for name in ("cpu.cfs_quota_us", "cpu.max", "memory.limit_in_bytes", "memory.max"):
            if os.path.exists(os.path.join(d, name)):
                files[name] = pathlib.Path(d, name).read_text().strip()
    assert files.get("cpu.cfs_quota_us", "30000") == "30000"
    assert files.get("cpu.max", "30000 100000") == "30000 100000"
    memory = files.get("memory.limit_in_bytes") or files.get("memory.max")
    assert memory == str(96 * 1024 * 1024), files


def test_exit_code_of_a_container(ctd, crictl, configs, pod) -> None:
    cid = run_container(crictl, configs, pod["id"], pod["file"], "seven", "exit 7")
    status = wait_for("exit", lambda: (s := crictl.inspect(cid)["status"])["state"]
                      == "CONTAINER_EXITED" and s)
    assert status["exitCode"] == 7
    assert status["reason"] == "Error"
    assert cid in crictl.ps("-a") and cid not in crictl.ps()
    crictl.run("rm", cid)
    assert cid not in crictl.ps("-a")
    assert leftovers(ctd, [cid]) == []


def test_stop_now_kills(ctd, crictl, configs, pod) -> None:
    """`stop -t 0` does not wait for a container that ignores SIGTERM: it is killed."""
    cid = run_container(crictl, configs, pod["id"], pod["file"], "sleeper",
                        "trap '' TERM; sleep 1000 & wait")
    assert crictl.run("stop", "-t", "0", cid).stdout.strip() == cid
    status = crictl.inspect(cid)["status"]
    assert (status["state"], status["exitCode"]) == ("CONTAINER_EXITED", 137)
    crictl.run("rm", cid)
    assert leftovers(ctd, [cid]) == []


# ---- removal -------------------------------------------------------------------------

def test_stopp_rmp_leave_nothing(ctd, crictl, configs) -> None:
    pod_file = write_config(configs, "pod-gone.json", pod_config(ctd, configs, "gone"))
    pod_id = crictl.runp(pod_file)
    cid = run_container(crictl, configs, pod_id, pod_file, "gone", "sleep 1000")
    assert crictl.inspect(cid)["status"]["state"] == "CONTAINER_RUNNING"
    assert [s for s in shims_of(ctd.address) if pod_id in s[1]], "no runc shim for the pod"
    # A ready pod is not removed without -f.
    refused = crictl.run("rmp", pod_id, check=False)
    assert refused.returncode == 1 and "stop it first" in refused.stderr
    assert crictl.run("stopp", pod_id).stdout.strip() == f"Stopped sandbox {pod_id}"
    assert crictl.run("rmp", pod_id).stdout.strip() == f"Removed sandbox {pod_id}"
    assert pod_id not in crictl.pods()
    assert cid not in crictl.ps("-a")
    assert leftovers(ctd, [pod_id, cid]) == []


def test_unknown_ids_fail_clearly(crictl) -> None:
    for args in (("inspect", "0123456789ab"), ("inspectp", "0123456789ab"),
                 ("stop", "0123456789ab")):
        result = crictl.run(*args, check=False)
        assert result.returncode == 1, args
        assert "not found" in result.stderr or "NotFound" in result.stderr, result.stderr


# ---- podvm through the CRI ------------------------------------------------------------

def test_podvm_pod_reaches_the_shim_and_leaves_nothing(ctd, crictl, configs) -> None:
    pod_file = write_config(configs, "pod-vm.json", pod_config(ctd, configs, "vm"))
    result = crictl.run("runp", "--runtime", "podvm", str(pod_file), check=False)
    # containerd picked the `podvm` runtime of the packaged snippet, started our shim and
    # relayed its answer; the answer names our configuration's QEMU: ConfigPath arrived.
    assert result.returncode == 1
    assert "run pod sandbox" in result.stderr
    assert BOGUS_QEMU in result.stderr and "podvm" in result.stderr, result.stderr
    log = ctd.log()
    sandboxes = set(re.findall(r"runtime=io\.containerd\.podvm\.v2 id=([0-9a-f]{64})", log))
    assert len(sandboxes) >= 1, "the podvm shim never logged through containerd"
    assert crictl.pods("--name", "^vm$") == []
    wait_for("the podvm shim to exit",
             lambda: not [s for s in shims_of(ctd.address) if "podvm" in s[1]], timeout=60)
    for sandbox in sandboxes:
        assert leftovers(ctd, [sandbox]) == []
        sock = paths.socket_path(paths.socket_address(ctd.address, CRI_NAMESPACE, sandbox))
        assert not os.path.exists(sock), sock
        assert not os.path.exists(paths.state_dir(CRI_NAMESPACE, sandbox))


# ---- the harness's configuration ------------------------------------------------------

def test_harness_builds_podvm_runtime_from_the_packaged_snippet(ctd) -> None:
    config = tomllib.loads(ctd.config.read_text())
    cri = config["plugins"]["io.containerd.grpc.v1.cri"]
    runtimes = cri["containerd"]["runtimes"]
    assert cri["containerd"]["default_runtime_name"] == "runc"
    snippet = tomllib.loads(PODVM_SNIPPET.read_text())
    packaged = snippet["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]["podvm"]
    assert runtimes["podvm"] == {**packaged, "options": {"ConfigPath": ctd.podvm_config}}
    assert packaged["options"] == {"ConfigPath": "/etc/podvm/configuration.toml"}
    assert packaged["pod_annotations"] == ["io.katacontainers.*", "storage.podvm.io/*"]
    assert packaged["privileged_without_host_devices"] is True
    assert cri["sandbox_image"] == "localhost/podvm/pause:local"
    # Only ConfigPath differs from the snippet's text.
    ours = podvm_runtime_section("/x/y.toml").splitlines()
    theirs = PODVM_SNIPPET.read_text().splitlines()
    assert [(a, b) for a, b in zip(ours, theirs) if a != b] == \
        [('    ConfigPath = "/x/y.toml"', '    ConfigPath = "/etc/podvm/configuration.toml"')]


def test_containerd_2_snippet_and_runtimeclass() -> None:
    v3 = tomllib.loads((REPO_ROOT / "packaging/containerd/config-v3.toml").read_text())
    podvm = v3["plugins"]["io.containerd.cri.v1.runtime"]["containerd"]["runtimes"]["podvm"]
    assert podvm["runtime_type"] == "io.containerd.podvm.v2"
    assert podvm["options"]["ConfigPath"] == "/etc/podvm/configuration.toml"
    assert "sandboxer" not in podvm  # the default: a pause container
    v3s = tomllib.loads((REPO_ROOT / "packaging/containerd/config-v3-sandboxer.toml")
                        .read_text())
    shim_mode = v3s["plugins"]["io.containerd.cri.v1.runtime"]["containerd"]["runtimes"][
        "podvm-sandboxer"]
    assert shim_mode["sandboxer"] == "shim"
    assert shim_mode["runtime_type"] == podvm["runtime_type"]
    assert shim_mode["options"] == podvm["options"]
    rc = (REPO_ROOT / "packaging/kubernetes/runtimeclass.yaml").read_text()
    assert re.search(r"^handler: podvm$", rc, re.M)
    assert re.search(r"^  podFixed:\n    memory: .+\n    cpu: .+$", rc, re.M)


def test_crictl_config_file_and_version(ctd, crictl, configs) -> None:
    config = configs / "crictl.yaml"
    config.write_text(f"# crictl config\nruntime-endpoint: {ctd.cri_endpoint}\n"
                      f'image-endpoint: "{ctd.cri_endpoint}"\ntimeout: 30\ndebug: false\n')
    out = subprocess.run([*crictl.program, "--config", str(config), "version"],
                         capture_output=True, text=True, cwd=REPO_ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "RuntimeName:  containerd" in out.stdout
    assert "RuntimeApiVersion:  v1" in out.stdout
    info = crictl.run("info").json()
    ready = {c["type"]: c["status"] for c in info["status"]["conditions"]}
    assert ready["RuntimeReady"] is True
    images = crictl.run("images", "-q").stdout.split()
    assert len(images) == 2  # busybox and the pause image


def test_unreachable_endpoint_is_a_clear_error(configs) -> None:
    result = Crictl(f"unix://{configs}/nothing.sock", timeout="2s").run("version", check=False)
    assert result.returncode == 1
    assert "nothing.sock" in result.stderr
