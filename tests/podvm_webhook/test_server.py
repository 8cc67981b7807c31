"""The real podvm-webhook over verified HTTPS, with AdmissionReviews shaped as the API
server sends them: what it patches, allows, warns about and refuses, what it answers to
bodies that are not reviews (and that it keeps serving), its metrics, its certificate
replaced on disk."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from shim.config import load
from shim.resources.annotations import KATA, apply_kata_overrides
from shim.resources.model import ContainerResources, PlanError, request_from_config

from testbed.webhook import (ROOT, apply_patch, container, decoded_patch, install,
                             make_certificate, pod, review)

OVERHEAD = {"cpu": "1", "memory": "448Mi"}  # 1 default vCPU; 256 MiB + QEMU's 192 (KVM)
STORAGE = "storage.podvm.io/limits"
UNBOUNDED_APP = '{"containers":{},"emptyDirs":{},"unbounded":["container:app"]}'


def test_static_mode_annotates_the_vm_it_sized(static_webhook) -> None:
    admitted = pod(container(cpu="2", memory="512Mi"), overhead=OVERHEAD)
    answer = static_webhook.review("mutate", admitted, uid="uid-static-1")
    response = answer.response
    assert response["uid"] == "uid-static-1" and response["allowed"] is True
    patch = decoded_patch(response)
    assert patch == [{"op": "add", "path": "/metadata/annotations", "value": {
        KATA + "default_vcpus": "1", KATA + "default_memory": "256",
        "podvm.io/vm": '{"vcpus":3,"memoryMiB":768}', STORAGE: UNBOUNDED_APP}}]
    assert "warnings" not in response
    validated = static_webhook.review("validate", apply_patch(admitted, patch)).response
    assert validated["allowed"] is True and "patch" not in validated


def test_existing_annotations_get_one_add_each_with_slashes_escaped(static_webhook) -> None:
    admitted = pod(container(cpu="500m", memory="128974848"), overhead=OVERHEAD,
                   annotations={"example.com/team": "a", "podvm.io/vm": "stale"})
    patch = decoded_patch(static_webhook.review("mutate", admitted).response)
    assert [op["path"] for op in patch] == [
        "/metadata/annotations/" + KATA + "default_vcpus",
        "/metadata/annotations/" + KATA + "default_memory",
        "/metadata/annotations/podvm.io~1vm",
        "/metadata/annotations/storage.podvm.io~1limits"]
    # 128974848 bytes = 123 MiB exactly; 0.5 CPU rounds the VM up to 2 vCPUs
    assert apply_patch(admitted, patch)["metadata"]["annotations"] == {
        "example.com/team": "a", KATA + "default_vcpus": "1", KATA + "default_memory": "256",
        "podvm.io/vm": '{"vcpus":2,"memoryMiB":379}', STORAGE: UNBOUNDED_APP}


def test_other_pods_are_allowed_untouched_whatever_they_hold(static_webhook) -> None:
    for runtime_class in (None, "runc", "kata"):
        other = pod(container(cpu="lots", memory="?"), runtime_class=runtime_class)
        for endpoint in ("mutate", "validate"):
            response = static_webhook.review(endpoint, other).response
            assert response["allowed"] is True
            assert not {"patch", "patchType", "warnings", "status"} & set(response)


def refused(webhook, manifest: dict, code: int = 403) -> str:
    for endpoint in ("mutate", "validate"):
        response = webhook.review(endpoint, manifest).response
        assert response["allowed"] is False, response
        assert response["status"]["code"] == code
        assert "patch" not in response
    return response["status"]["message"]


def test_static_refuses_requests_that_differ_from_limits(static_webhook) -> None:
    c = container("app", cpu="2", memory="512Mi", requests={"cpu": "500m", "memory": "256Mi"})
    message = refused(static_webhook, pod(c, overhead=OVERHEAD))
    assert "static sizing" in message
    assert "spec.containers[0] (app) requests.cpu 500m != limits.cpu 2000m" in message
    assert "set requests.cpu = limits.cpu" in message
    assert "requests.memory 256Mi != limits.memory 512Mi" in message


def test_static_refuses_a_container_without_a_memory_limit(static_webhook) -> None:
    sidecar = container("log", cpu="100m")
    message = refused(static_webhook, pod(container(cpu="1", memory="64Mi"), sidecar,
                                          overhead=OVERHEAD))
    assert "spec.containers[1] (log) has no limits.memory" in message
    assert "set limits.memory" in message
    init = container("init", memory="64Mi", requests={"memory": "32Mi"})
    manifest = pod(container(cpu="1", memory="64Mi"), overhead=OVERHEAD)
    manifest["spec"]["initContainers"] = [init]
    assert "spec.initContainers[0] (init) requests.memory 32Mi != limits.memory 64Mi" in \
        refused(static_webhook, manifest)


def test_static_refuses_a_vm_above_the_maximum(static_webhook) -> None:
    message = refused(static_webhook, pod(container(cpu="1", memory="2Gi"), overhead=OVERHEAD))
    assert "2304 MiB of VM memory but at most 2048 MiB" in message
    assert "default_maxmemory" in message


def test_static_refuses_an_overhead_smaller_than_the_plans(static_webhook) -> None:
    no_cpu_limit = container(memory="512Mi")
    message = refused(static_webhook, pod(no_cpu_limit, overhead={"cpu": "250m",
                                                                    "memory": "448Mi"}))
    assert "is memory 448Mi, cpu 250m" in message
    assert "set the RuntimeClass's overhead.podFixed to memory: 448Mi, cpu: 1000m" in message
    # the memory the pod cgroup lacks: the shim's own check on the node says it
    for overhead in (None, {"cpu": "1", "memory": "256Mi"}):
        message = refused(static_webhook, pod(container(memory="512Mi"), overhead=overhead))
        assert "its pod cgroup allows" in message
        assert "overhead.podFixed.memory >= 448Mi" in message


def test_dynamic_mode_warns_about_the_overhead_and_patches_nothing(dynamic_webhook) -> None:
    mismatched = pod(container(cpu="2", memory="512Mi", requests={"cpu": "500m"}),
                     overhead={"cpu": "2", "memory": "1Gi"})
    response = dynamic_webhook.review("mutate", mismatched).response
    assert response["allowed"] is True  # the storage annotation alone (no sizing ones)
    assert decoded_patch(response) == [{"op": "add", "path": "/metadata/annotations",
                                        "value": {STORAGE: UNBOUNDED_APP}}]
    (warning,) = response["warnings"]
    assert "is memory 1024Mi, cpu 2000m" in warning and "memory: 448Mi, cpu: 1000m" in warning
    none = dynamic_webhook.review("mutate", pod(container(requests={"cpu": "1"}),
                                                overhead=None)).response
    assert none["allowed"] is True
    assert "spec.overhead (RuntimeClass podvm's overhead.podFixed) is none" in \
        none["warnings"][0]
    exact = dynamic_webhook.review("mutate", pod(container(cpu="2", memory="512Mi"),
                                                 overhead=OVERHEAD)).response
    assert exact["allowed"] is True and "warnings" not in exact
    # refused only what can never fit
    message = refused(dynamic_webhook, pod(container(cpu="1", memory="4Gi"), overhead=OVERHEAD))
    assert "(dynamic sizing)" in message and "at most 2048 MiB" in message


def test_user_annotations_are_judged_as_the_shim_judges_them(static_webhook) -> None:
    config = load(str(static_webhook.config))
    kept = pod(container(cpu="1", memory="256Mi"), overhead={"cpu": "1", "memory": "704Mi"},
               annotations={KATA + "default_memory": "512"})
    patch = decoded_patch(static_webhook.review("mutate", kept).response)
    annotations = apply_patch(kept, patch)["metadata"]["annotations"]
    assert annotations[KATA + "default_memory"] == "512"  # the user's, kept
    assert annotations["podvm.io/vm"] == '{"vcpus":2,"memoryMiB":768}'
    for key, value in ((KATA + "default_maxvcpus", "4"), (KATA + "kernel_params", "x"),
                       (KATA + "default_vcpus", "two"), (KATA + "default_vcpus", "0")):
        gate = request_from_config(config, ContainerResources())
        with pytest.raises(PlanError) as shim_says:
            apply_kata_overrides(gate, {key: value}, config.qemu.enable_annotations,
                                 config.source)
        manifest = pod(container(cpu="1", memory="256Mi"), overhead=OVERHEAD,
                       annotations={key: value})
        assert str(shim_says.value) in refused(static_webhook, manifest)


def test_bad_input_is_answered_and_the_server_keeps_serving(static_webhook) -> None:
    post = static_webhook.request
    without_uid = review(pod(container()))
    del without_uid["request"]["uid"]
    answers = {
        "not JSON": post("POST", "/mutate", b'{"apiVersion": "admission'),
        "not an object": post("POST", "/validate", b"[1, 2]"),
        "deep nesting": post("POST", "/mutate", b"[" * 100_000 + b"]" * 100_000),
        "v1beta1": post("POST", "/mutate", json.dumps(
            {**review(pod(container())), "apiVersion": "admission.k8s.io/v1beta1"}).encode()),
        "no request": post("POST", "/mutate", json.dumps(
            {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"}).encode()),
        "empty uid": post("POST", "/mutate", json.dumps(
            review(pod(container()), uid="")).encode()),
        "no uid": post("POST", "/mutate", json.dumps(without_uid).encode()),
    }
    for what, answer in answers.items():
        assert answer.status == 400, (what, answer)
    assert b"not JSON" in answers["not JSON"].body
    assert b"admissionReviewVersions: [v1]" in answers["v1beta1"].body
    assert b"no uid" in answers["no uid"].body
    too_big = post("POST", "/mutate", b" " * (4 << 20))
    assert too_big.status == 413
    deployment = static_webhook.review(
        "mutate", {"kind": "Deployment"}, kind={"group": "apps", "version": "v1",
                                                "kind": "Deployment"}).response
    assert deployment["allowed"] is False and deployment["status"]["code"] == 400
    assert "v1 Pods only" in deployment["status"]["message"]
    for bad in ({"cpu": "two"}, {"memory": "1GB"}, {"cpu": ["1"]}):
        c = container()
        c["resources"] = {"limits": bad}
        message = refused(static_webhook, pod(c, overhead=OVERHEAD), code=400)
        assert f"spec.containers[0].resources.limits.{next(iter(bad))}" in message
    garbage = pod(container(), overhead=OVERHEAD)
    garbage["spec"]["containers"] = "app"
    assert "spec.containers must be a list" in refused(static_webhook, garbage, code=400)
    assert static_webhook.alive()
    assert static_webhook.get("/healthz").status == 200
    assert static_webhook.review("mutate", pod(container(cpu="1", memory="64Mi"),
                                               overhead=OVERHEAD)).response["allowed"]


def test_metrics_count_verdicts_and_time_every_answer(dynamic_webhook) -> None:
    before = metrics(dynamic_webhook)
    dynamic_webhook.review("mutate", pod(container(cpu="1", memory="64Mi"), overhead=OVERHEAD))
    dynamic_webhook.review("validate", pod(container(), runtime_class="runc"))
    dynamic_webhook.review("mutate", pod(container(cpu="1", memory="64Gi"), overhead=OVERHEAD))
    dynamic_webhook.request("POST", "/mutate", b"{")
    after = metrics(dynamic_webhook)

    def grew(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)

    # the storage annotation is added in dynamic mode too
    assert grew('podvm_webhook_requests_total{endpoint="mutate",verdict="patched"}') == 1
    assert grew('podvm_webhook_requests_total{endpoint="validate",verdict="ignored"}') == 1
    assert grew('podvm_webhook_requests_total{endpoint="mutate",verdict="refused"}') == 1
    assert grew('podvm_webhook_requests_total{endpoint="mutate",verdict="invalid"}') == 1
    assert grew("podvm_webhook_admission_duration_seconds_count") == 4
    assert grew('podvm_webhook_admission_duration_seconds_bucket{le="+Inf"}') == 4
    assert grew("podvm_webhook_admission_duration_seconds_sum") > 0
    buckets = [v for k, v in after.items() if k.startswith(
        "podvm_webhook_admission_duration_seconds_bucket")]
    assert buckets == sorted(buckets)  # cumulative


def metrics(webhook) -> dict[str, float]:
    """Every sample as Prometheus' own parser reads it, keyed `name{label="value",...}`."""
    answer = webhook.get("/metrics")
    assert answer.status == 200
    return {s.name + ("{" + ",".join(f'{k}="{v}"' for k, v in s.labels.items()) + "}"
                      if s.labels else ""): s.value
            for family in text_string_to_metric_families(answer.body.decode())
            for s in family.samples}


def test_a_certificate_replaced_on_disk_serves_new_connections(webhook) -> None:
    assert webhook.served_certificate_cn() == "first"
    second_cert, second_key = make_certificate(webhook.workdir / "made", "second")
    third_cert, _ = make_certificate(webhook.workdir / "made", "third")
    # half a rotation (a certificate whose key is not there yet) is not applied
    install(third_cert, webhook.cert)
    time.sleep(1.0)
    assert webhook.served_certificate_cn() == "first"
    assert metrics(webhook)['podvm_webhook_certificate_reloads_total{result="failure"}'] >= 1
    install(second_key, webhook.key)
    install(second_cert, webhook.cert)
    deadline = time.monotonic() + 10
    while webhook.served_certificate_cn() != "second":
        assert time.monotonic() < deadline, webhook.log_text()
        time.sleep(0.1)
    webhook.trusted = [second_cert]  # a client that trusts only the new one gets answers
    assert webhook.review("mutate", pod(container(cpu="1", memory="64Mi"),
                                        overhead=OVERHEAD)).response["allowed"]
    assert metrics(webhook)['podvm_webhook_certificate_reloads_total{result="success"}'] == 1


def test_a_server_that_cannot_start_says_why(tmp_path) -> None:
    cert, key = make_certificate(tmp_path, "start")
    bad_config = tmp_path / "bad.toml"
    bad_config.write_text("[hypervisor.qemu]\ndefault_vcpus = 0\n")
    cases = {
        "default_vcpus must be at least 1": ["--cert", cert, "--key", key,
                                             "--config", bad_config],
        "cannot load the certificate": ["--cert", cert, "--key", cert],
        "configuration file not found": ["--cert", cert, "--key", key,
                                         "--config", tmp_path / "missing.toml"],
    }
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    cases["cannot listen on 127.0.0.1"] = ["--cert", cert, "--key", key, "--address",
                                           "127.0.0.1", "--port", taken.getsockname()[1]]
    for says, args in cases.items():
        done = subprocess.run([sys.executable, "-m", "podvm_webhook.cli", *map(str, args)],
                              cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert done.returncode == 1 and says in done.stderr, (says, done.stderr)
    taken.close()


def test_the_pods_ephemeral_storage_is_annotated_and_a_users_judged(dynamic_webhook) -> None:
    app = container("app", memory="64Mi")
    app["resources"]["limits"]["ephemeral-storage"] = "200Mi"
    init = container("init")
    init["resources"]["limits"]["ephemeral-storage"] = "1G"
    manifest = pod(app, container("log"), overhead=OVERHEAD)
    manifest["spec"]["initContainers"] = [init]
    manifest["spec"]["volumes"] = [
        {"name": "cache", "emptyDir": {"sizeLimit": "50Mi"}},
        {"name": "scratch", "emptyDir": {}},
        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}},
        {"name": "conf", "configMap": {"name": "x"}}]
    patch = decoded_patch(dynamic_webhook.review("mutate", manifest).response)
    value = json.loads(apply_patch(manifest, patch)["metadata"]["annotations"][STORAGE])
    assert value == {"containers": {"app": 200 << 20, "init": 10 ** 9},
                     "emptyDirs": {"cache": 50 << 20},
                     "unbounded": ["container:log", "emptyDir:scratch"]}
    # one the user set is kept (nothing added), and refused when the shim would refuse it
    mine = pod(container(), overhead=OVERHEAD,
               annotations={STORAGE: '{"containers": {"app": 1048576}}'})
    kept = dynamic_webhook.review("mutate", mine).response
    assert kept["allowed"] is True and "patch" not in kept
    bad = pod(container(), overhead=OVERHEAD, annotations={STORAGE: '{"containers": {"a": -1}}'})
    message = refused(dynamic_webhook, bad)
    assert STORAGE in message and "negative" in message
    broken = pod(app, overhead=OVERHEAD)
    broken["spec"]["volumes"] = [{"name": "v", "emptyDir": {"sizeLimit": "lots"}}]
    assert "spec.volumes[0].emptyDir.sizeLimit" in refused(dynamic_webhook, broken, code=400)
