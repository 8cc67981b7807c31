"""`podvmctl plan`: a manifest's pods judged as the webhook judges them, at a terminal."""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys

from shim.resources.annotations import KATA

from testbed.webhook import ROOT
from tests.podvm_webhook.conftest import STATIC_CONFIG

RUNTIME_CLASS = ROOT / "packaging" / "kubernetes" / "runtimeclass.yaml"
PACKAGED_CONFIG = ROOT / "packaging" / "configuration.toml"
DEPLOYMENT = """\
apiVersion: apps/v1
kind: Deployment
metadata:
  name: web
spec:
  replicas: 2
  selector: {matchLabels: {app: web}}
  template:
    metadata:
      labels: {app: web}
    spec:
      runtimeClassName: podvm
      initContainers:
      - name: migrate
        image: busybox
        resources:
          limits: {cpu: 3, memory: 1Gi}
      containers:
      - name: app
        image: busybox
        resources:
          limits: {cpu: 1.5, memory: 512Mi}
---
apiVersion: v1
kind: Pod
metadata:
  name: plain
spec:
  containers:
  - name: app
    image: busybox
"""


def podvmctl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "podvmctl.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def test_the_packaged_runtime_class_fits_the_packaged_configuration(tmp_path) -> None:
    manifest = tmp_path / "web.yaml"
    manifest.write_text(DEPLOYMENT)
    done = podvmctl("plan", str(RUNTIME_CLASS), str(manifest), "--config", str(PACKAGED_CONFIG))
    assert done.returncode == 0, done.stderr
    # the init container's 3 CPUs and 1 GiB outweigh the app's 1.5 and 512 MiB
    assert "Deployment web (its pod template): ADMITTED" in done.stdout
    assert "VM: 4 vCPUs, 1280 MiB" in done.stdout
    assert "warning" not in done.stdout  # the RuntimeClass declares what the plan needs
    assert "Pod plain: not a podvm pod" in done.stdout
    assert "vCPUs ceil(1 + 3) = 4" in done.stdout  # the plan's reasons


def test_static_mode_prints_annotations_and_refusals(tmp_path) -> None:
    config = tmp_path / "static.toml"
    config.write_text(STATIC_CONFIG)
    manifest = tmp_path / "pods.json"
    manifest.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": [
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "ok"},
         "spec": {"runtimeClassName": "podvm", "overhead": {"cpu": "1", "memory": "448Mi"},
                  "containers": [{"name": "a", "resources": {"limits": {
                      "cpu": "1", "memory": "256Mi"}}}]}},
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "burstable"},
         "spec": {"runtimeClassName": "podvm", "overhead": {"cpu": "1", "memory": "448Mi"},
                  "containers": [{"name": "a", "resources": {
                      "requests": {"cpu": "100m", "memory": "64Mi"},
                      "limits": {"cpu": "1", "memory": "256Mi"}}}]}}]}))
    done = podvmctl("plan", str(manifest), "--config", str(config))
    assert done.returncode == 1  # a pod is refused
    assert "Pod ok: ADMITTED" in done.stdout
    assert f"annotation: {KATA}default_vcpus=1" in done.stdout
    assert 'annotation: podvm.io/vm={"vcpus":2,"memoryMiB":512}' in done.stdout
    assert "Pod burstable: REFUSED" in done.stdout
    assert "refused: spec.containers[0] (a) requests.cpu 100m != limits.cpu 1000m" in \
        done.stdout
    as_json = json.loads(podvmctl("plan", str(manifest), "--config", str(config),
                                  "--json").stdout)
    assert [(p["object"], p["allowed"]) for p in as_json] == [("Pod ok", True),
                                                              ("Pod burstable", False)]
    assert as_json[0]["plan"]["vcpus"] == 2


def test_what_cannot_be_read_is_said(tmp_path: pathlib.Path) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text("kind: Pod\nspec: [\n")
    done = podvmctl("plan", str(broken))
    assert done.returncode == 1 and "not valid YAML" in done.stderr
    done = podvmctl("plan", str(tmp_path / "missing.yaml"))
    assert done.returncode == 1 and "cannot read" in done.stderr
    service = tmp_path / "service.yaml"
    service.write_text("apiVersion: v1\nkind: Service\nmetadata: {name: s}\n")
    done = podvmctl("plan", str(service))
    assert done.returncode == 1 and "no Pod and no pod template" in done.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("kind: Pod\nspec:\n  runtimeClassName: podvm\n  containers:\n"
                   "  - name: a\n    resources: {limits: {memory: 1 GB}}\n")
    done = podvmctl("plan", str(bad))
    assert done.returncode == 1
    assert "spec.containers[0].resources.limits.memory: '1 GB' is not a Kubernetes " \
           "quantity" in done.stdout


def test_the_plan_shows_the_pods_scratch_disk(tmp_path) -> None:
    manifest = tmp_path / "disk.yaml"
    manifest.write_text(
        "apiVersion: v1\nkind: Pod\nmetadata: {name: disk}\nspec:\n  runtimeClassName: podvm\n"
        "  containers:\n  - name: app\n    resources:\n"
        "      limits: {memory: 64Mi, ephemeral-storage: 200Mi}\n"
        "  volumes:\n  - {name: cache, emptyDir: {sizeLimit: 50Mi}}\n"
        "  - {name: shm, emptyDir: {medium: Memory}}\n")
    done = podvmctl("plan", str(RUNTIME_CLASS), str(manifest), "--config", str(PACKAGED_CONFIG))
    assert done.returncode == 0, done.stderr
    # 250 MiB of limits + 2% + 16 MiB for ext4; the Memory emptyDir is not on the disk
    assert "VM: 1 vCPUs, 320 MiB, a 271 MiB scratch disk" in done.stdout, done.stdout
    assert "scratch disk 271 MiB = limits 250 MiB (1 containers, 1 emptyDirs)" in done.stdout
    assert 'annotation: storage.podvm.io/limits={"containers":{"app":209715200},' \
           '"emptyDirs":{"cache":52428800},"unbounded":[]}' in done.stdout
