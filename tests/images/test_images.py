"""The images `make images` writes (images/build.py), checked as the tools that take them
see them: every digest and size of each OCI layout against its blobs, the config's
diff_ids against the uncompressed layers, both archives read by skopeo, a second build
byte for byte the same; then imported into a real containerd (one for the module) and run
by it with runc: the webhook serves AdmissionReviews over verified HTTPS as
packaging/kubernetes/webhook.yaml runs it, unprivileged, on a read-only root, and code
run in it as its user can neither write the image nor become root; the node image runs
`podvm-node` from its /opt/podvm, and its monitor serves the metrics of a running podvm
pod as the DaemonSet runs it."""
from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import pathlib
import re
import subprocess
import tarfile
import time
import urllib.request
import uuid

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from images import build, python
from images.oci import LAYER, MANIFEST
from shim.host import paths
from shim.host.podstate import PodState, state_path
from testbed.containerd import Containerd
from testbed.prereqs import require_root, require_tool
from testbed.vmconfig import write_test_config
from testbed.webhook import ROOT, Webhook, container, decoded_patch, free_port, pod
from tests.podvm_webhook.conftest import STATIC_CONFIG

pytestmark = pytest.mark.containerd

OUT = ROOT / "build" / "images"
WEBHOOK, NODE = (f"docker.io/library/{name}:{build.TAG}" for name in build.NAMES)
OVERHEAD = {"cpu": "1", "memory": "448Mi"}  # as tests/podvm_webhook/test_server.py's


@pytest.fixture(scope="module")
def built() -> dict:
    started = time.monotonic()
    made = build.build(OUT)
    print(f"images ready in {time.monotonic() - started:.1f}s")
    return made


@pytest.fixture(scope="module")
def containerd(tmp_path_factory, built):
    require_root()
    require_tool("containerd", "containerd")
    require_tool("runc", "runc")
    ctr = Containerd(tmp_path_factory.mktemp("images-containerd")).start()
    try:
        # One of each archive kind: both must import.
        ctr.ctr("images", "import", str(OUT / "podvm-webhook.oci.tar"))
        ctr.ctr("images", "import", str(OUT / "podvm-node.docker.tar"))
        yield ctr
    finally:
        ctr.stop()
        assert not ctr.forced, ctr.forced


def _sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _blob(layout: pathlib.Path, descriptor: dict) -> bytes:
    """The blob a descriptor names, checked against its digest and size."""
    data = (layout / "blobs/sha256" / descriptor["digest"].split(":")[1]).read_bytes()
    assert _sha256(data) == descriptor["digest"]
    assert len(data) == descriptor["size"]
    return data


def _image(layout: pathlib.Path) -> tuple[dict, dict, list[bytes]]:
    """(index entry, config, uncompressed layers) of the layout's one image, every
    descriptor on the way checked."""
    assert json.loads((layout / "oci-layout").read_text()) == {"imageLayoutVersion": "1.0.0"}
    [entry] = json.loads((layout / "index.json").read_text())["manifests"]
    assert entry["mediaType"] == MANIFEST
    manifest = json.loads(_blob(layout, entry))
    assert manifest["schemaVersion"] == 2 and manifest["mediaType"] == MANIFEST
    config = json.loads(_blob(layout, manifest["config"]))
    assert all(layer["mediaType"] == LAYER for layer in manifest["layers"])
    layers = [gzip.decompress(_blob(layout, layer)) for layer in manifest["layers"]]
    assert config["rootfs"] == {"type": "layers", "diff_ids": [_sha256(t) for t in layers]}
    named = {d["digest"].split(":")[1] for d in [entry, manifest["config"], *manifest["layers"]]}
    assert set(os.listdir(layout / "blobs/sha256")) == named, "blobs nothing names"
    return entry, config, layers


def _members(archive: pathlib.Path) -> dict[str, bytes]:
    with tarfile.open(archive) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


@pytest.mark.parametrize("name", build.NAMES)
def test_each_layout_holds_what_its_index_manifest_and_config_say(built, name) -> None:
    layout = OUT / name
    entry, config, layers = _image(layout)
    assert entry["annotations"]["io.containerd.image.name"] == built[name]["reference"]
    assert entry["digest"] == built[name]["manifest"]
    # The oci-archive is the layout, file for file.
    assert _members(OUT / f"{name}.oci.tar") == {
        str(p.relative_to(layout)): p.read_bytes() for p in layout.rglob("*") if p.is_file()}
    # The docker-archive: its config is the same blob, its layers the same tars.
    docker = _members(OUT / f"{name}.docker.tar")
    [saved] = json.loads(docker["manifest.json"])
    assert saved["RepoTags"] == [f"{name}:{build.TAG}"]
    assert json.loads(docker[saved["Config"]]) == config
    assert [_sha256(docker[n]) for n in saved["Layers"]] == config["rootfs"]["diff_ids"]
    assert sum(map(len, layers)) == built[name]["unpacked_bytes"]


def test_layers_have_fixed_times_and_owners_and_no_docs_or_caches(built) -> None:
    _, config, layers = _image(OUT / "podvm-webhook")
    epoch = json.loads((OUT / "images.json").read_text())["inputs"]["source_date_epoch"]
    names = []
    for data in layers:
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            members = tar.getmembers()
        assert {(m.mtime, m.uname, m.gname) for m in members} == {(epoch, "", "")}
        assert {(m.uid, m.gid) for m in members} == {(0, 0)}
        names += [m.name for m in members]
    assert config["created"] == time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))
    for unwanted in ("usr/share/doc/", "usr/share/man/", "/__pycache__/",
                     "usr/lib/python3.11/test/"):
        assert not [n for n in names if unwanted in n + "/"], unwanted
    assert "usr/lib/python3.11/json/__init__.pyc" in names  # bytecode made at build time
    assert "usr/lib/python3.11/json/__init__.py" not in names


def test_a_second_build_gives_the_same_bytes(built, tmp_path) -> None:
    """Made again from the same inputs (those images.json lists: the same .debs, wheels
    and sources), the webhook's archives are the same, byte for byte. (The node image's
    layers are made by the same code, from podvm_node/bundle.py's tree: 14 s more.)"""
    manifest = json.loads((OUT / "images.json").read_text())["inputs"]
    started = time.monotonic()
    again = build.assemble(manifest, tmp_path, OUT / "cache", build.DEFAULT_BUNDLE,
                           names=("podvm-webhook",))
    print(f"made again in {time.monotonic() - started:.1f}s")
    assert python.sources_digest() == manifest["podvm"], "podvm changed during the test"
    assert again["podvm-webhook"] == built["podvm-webhook"]
    for archive in ("podvm-webhook.oci.tar", "podvm-webhook.docker.tar"):
        assert (tmp_path / archive).read_bytes() == (OUT / archive).read_bytes(), archive


@pytest.mark.parametrize("transport", ["oci-archive", "docker-archive"])
def test_skopeo_copies_both_archives(built, tmp_path, transport) -> None:
    skopeo = require_tool("skopeo", "skopeo")
    suffix = "oci" if transport == "oci-archive" else "docker"
    source = f"{transport}:{OUT / f'podvm-webhook.{suffix}.tar'}"
    subprocess.run([skopeo, "copy", "-q", source, f"oci:{tmp_path / 'copy'}:{build.TAG}"],
                   check=True, capture_output=True, timeout=120)
    _, config, _ = _image(tmp_path / "copy")
    assert config["config"]["User"] == "65532:65532"


def _webhook_command(port: int) -> list[str]:
    """The container's command and arguments as webhook.yaml gives them, on `port` of
    the loopback address (the test runs it in the host's network namespace)."""
    for doc in yaml.safe_load_all(build.WEBHOOK_MANIFEST.read_text()):
        if doc and doc.get("kind") == "Deployment":
            spec = doc["spec"]["template"]["spec"]["containers"][0]
    args = [re.sub(r"^--port=\d+$", f"--port={port}", a) for a in spec["args"]]
    assert args != spec["args"], "webhook.yaml names no --port"
    return [*spec["command"], *args, "--address=127.0.0.1"]


def _task_pid(ctr: Containerd, task: str) -> int:
    for line in ctr.ctr("tasks", "ls").stdout.decode().splitlines()[1:]:
        fields = line.split()
        if fields[0] == task:
            return int(fields[1])
    raise AssertionError(f"no task {task}")


def _status(pid: int) -> dict[str, str]:
    lines = pathlib.Path(f"/proc/{pid}/status").read_text().splitlines()
    return dict(line.split(":\t", 1) for line in lines if ":\t" in line)


# Run inside the webhook's container as its user: what an attacker who took the server
# over would try first. Every attempt must fail: /tmp (mode 1777) only because the root is
# read-only, the code and the key because root owns them, setuid because the user has no
# capability.
ATTACKS = """
import errno, os
def attempt(what, action):
    try:
        action()
    except OSError as exc:
        print(what, errno.errorcode[exc.errno])
    else:
        print(what, "SUCCEEDED")
attempt("create-in-root", lambda: open("/evil", "w"))
attempt("create-in-tmp", lambda: open("/tmp/evil", "w"))
attempt("write-code", lambda: open("/usr/local/bin/podvm-webhook", "a"))
attempt("write-key", lambda: open("/etc/podvm-webhook/tls/tls.key", "a"))
attempt("setuid-root", lambda: os.setuid(0))
print("uid", os.getuid(), os.getgid())
"""


def test_the_webhook_image_serves_reviews_unprivileged_on_a_read_only_root(
        containerd, tmp_path) -> None:
    webhook = Webhook(tmp_path / "webhook", STATIC_CONFIG)
    for path in [webhook.workdir, *webhook.workdir.iterdir()]:
        path.chmod(0o755 if path.is_dir() else 0o644)  # as a Secret's files are (0644)
    task = f"webhook-{uuid.uuid4().hex[:8]}"
    volumes = [f"type=bind,src={webhook.workdir},dst={dst},options=rbind:ro"
               for dst in ("/etc/podvm-webhook/tls", "/etc/podvm")]
    containerd.ctr("run", "-d", "--net-host", "--read-only",
                   "--log-uri", f"file://{tmp_path / 'webhook.log'}",
                   *(a for v in volumes for a in ("--mount", v)), WEBHOOK, task,
                   *_webhook_command(webhook.port))
    try:
        _wait_ready(webhook, tmp_path / "webhook.log")
        response = webhook.review("mutate", pod(container(cpu="2", memory="512Mi"),
                                                overhead=OVERHEAD)).response
        assert response["allowed"] is True
        assert decoded_patch(response)[0]["value"]["podvm.io/vm"] == \
            '{"vcpus":3,"memoryMiB":768}'
        status = _status(_task_pid(containerd, task))
        assert status["Uid"].split() == ["65532"] * 4 and status["Gid"].split() == ["65532"] * 4
        assert int(status["CapEff"], 16) == 0 and int(status["CapPrm"], 16) == 0
        attacked = containerd.ctr("tasks", "exec", "--exec-id", "attack", task,
                                  "/usr/bin/python3", "-c", ATTACKS).stdout.decode()
        assert attacked.split("\n") == [
            "create-in-root EROFS", "create-in-tmp EROFS", "write-code EACCES",
            "write-key EACCES", "setuid-root EPERM", "uid 65532 65532", ""], attacked
    finally:
        containerd.ctr("tasks", "kill", "-s", "SIGTERM", task, check=False)
        _wait_stopped(containerd, task)
        containerd.ctr("tasks", "delete", task, check=False)
        containerd.ctr("containers", "delete", task, check=False)
    assert "Traceback" not in (tmp_path / "webhook.log").read_text()


def _wait_ready(webhook: Webhook, log: pathlib.Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if webhook.get("/readyz").status == 200:
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"the webhook container did not get ready: "
                                 f"{log.read_text(errors='replace') if log.exists() else ''}")
        time.sleep(0.2)


def _wait_stopped(ctr: Containerd, task: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        listed = ctr.ctr("tasks", "ls").stdout.decode().splitlines()[1:]
        if not any(line.split()[0] == task and line.split()[2] == "RUNNING" for line in listed):
            return
        time.sleep(0.1)
    raise AssertionError(f"task {task} still runs {timeout}s after SIGTERM")


def test_the_node_image_runs_podvm_node_from_opt_podvm(containerd) -> None:
    task = f"node-{uuid.uuid4().hex[:8]}"
    out = containerd.ctr("run", "--rm", NODE, task, "podvm-node", "--help").stdout.decode()
    assert "usage: podvm-node" in out
    assert all(command in out for command in ("install", "uninstall", "monitor")), out
    task = f"node-{uuid.uuid4().hex[:8]}"
    # nsenter: what podvm_node/install.py restarts the host's containerd with.
    out = containerd.ctr("run", "--rm", NODE, task, "nsenter", "--version").stdout.decode()
    assert out.startswith("nsenter from util-linux"), out


def test_the_node_image_monitor_serves_a_running_podvm_pod(containerd, tmp_path) -> None:
    """As the DaemonSet runs it (the host's root at /host, the host's pid namespace and
    network) beside a real podvm pod (a container in its own VM, started through this
    containerd): the values its shim recorded and what its VM and cgroup hold now."""
    image = containerd.import_busybox(tmp_path)
    config = write_test_config(tmp_path / "podvm.toml")
    vm = f"vm-{uuid.uuid4().hex[:8]}"
    containerd.ctr("run", "-d", "--runtime", "io.containerd.podvm.v2", "--runtime-config-path",
                   str(config), image, vm, "sleep", "600")
    port = free_port()
    task = f"monitor-{uuid.uuid4().hex[:8]}"
    try:
        state = PodState.load(state_path(paths.state_dir(containerd.namespace, vm)))
        containerd.ctr("run", "-d", "--net-host", "--with-ns", f"pid:/proc/{os.getpid()}/ns/pid",
                       "--log-uri", f"file://{tmp_path / 'monitor.log'}",
                       "--mount", "type=bind,src=/,dst=/host,options=rbind:ro", NODE,
                       task, "podvm-node", "monitor", f"--listen=127.0.0.1:{port}",
                       "--host-root=/host")
        try:
            samples = _scrape(port, tmp_path / "monitor.log")
        finally:
            _remove_task(containerd, task, "SIGTERM")
    finally:
        _remove_task(containerd, vm, "SIGKILL")

    def value(name: str, **labels: str) -> float:
        return next(s.value for s in samples[f"podvm_sandbox_{name}"]
                    if s.labels["sandbox_id"] == vm and
                    all(s.labels.get(k) == v for k, v in labels.items()))

    assert value("running") == 1
    assert (value("plan_vcpus"), value("plan_memory_bytes")) == \
        (state.plan.vcpus, state.plan.memory_mib << 20)
    assert value("boot_seconds") == pytest.approx(state.boot_seconds)
    assert value("guest_online_vcpus") == state.plan.vcpus
    assert 0.5 * (state.plan.memory_mib << 20) < value("guest_memory_total_bytes") <= \
        state.plan.memory_mib << 20
    assert value("memory_charged_bytes") > 32 << 20, "QEMU's memory is charged to the pod"
    assert value("vmm_cpu_seconds_total", role="vcpu") > 0


def _remove_task(containerd: Containerd, task: str, signal: str) -> None:
    containerd.ctr("tasks", "kill", "-s", signal, task, check=False)
    _wait_stopped(containerd, task, timeout=60)
    containerd.ctr("tasks", "delete", task, check=False)
    containerd.ctr("containers", "delete", task, check=False)


def _scrape(port: int, log: pathlib.Path, timeout: float = 60) -> dict[str, list]:
    """Every sample of the monitor's /metrics by name, as Prometheus' parser reads it."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
                body = r.read().decode()
            break
        except OSError:
            if time.monotonic() > deadline:
                raise AssertionError(f"the monitor did not serve: "
                                     f"{log.read_text() if log.exists() else ''}") from None
            time.sleep(0.2)
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples
