"""packaging/kubernetes/webhook.yaml holds together: the server it runs takes its
arguments and serves its probes, the Service and both webhook configurations point at it,
the certificate cert-manager makes is the one it mounts, and its ConfigMap is the
configuration the nodes are packaged with."""
from __future__ import annotations

import tomllib

import yaml

from shim import config
from podvm_webhook.cli import parser
from podvm_webhook.metrics import Metrics
from podvm_webhook.policy import Policy
from podvm_webhook.server import make_app

from testbed.webhook import ROOT

KUBERNETES = ROOT / "packaging" / "kubernetes"


def objects(name: str) -> dict[str, dict]:
    docs = list(yaml.safe_load_all((KUBERNETES / name).read_text()))
    found = {d["kind"]: d for d in docs}
    assert len(found) == len(docs), "one object of each kind"
    return found


def issuers_and_certificates() -> list[dict]:
    return list(yaml.safe_load_all((KUBERNETES / "webhook-cert-manager.yaml").read_text()))


def test_the_deployment_runs_the_server_as_packaged() -> None:
    o = objects("webhook.yaml")
    assert set(o) == {"Namespace", "ServiceAccount", "ConfigMap", "Deployment", "Service",
                      "MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"}
    deployment = o["Deployment"]
    assert deployment["spec"]["replicas"] == 2
    pod = deployment["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts[c["command"][0]] == "podvm_webhook.cli:main"
    args = parser().parse_args(c["args"])
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert args.cert.startswith(mounts["tls"] + "/") and args.key.startswith(mounts["tls"])
    assert args.config == mounts["config"] + "/configuration.toml"
    port = next(p for p in c["ports"] if p["name"] == "https")["containerPort"]
    assert args.port == port
    served = {r.resource.canonical for r in
              make_app(Policy(config.Config()), Metrics()).router.routes()}
    for probe in ("readinessProbe", "livenessProbe"):
        get = c[probe]["httpGet"]
        assert get["scheme"] == "HTTPS" and get["port"] == "https" and get["path"] in served
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["config"]["configMap"]["name"] == o["ConfigMap"]["metadata"]["name"]
    secret = volumes["tls"]["secret"]["secretName"]
    certificate = next(d for d in issuers_and_certificates()
                       if d["kind"] == "Certificate" and d["spec"]["secretName"] == secret)
    service = o["Service"]
    dns = f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc"
    assert dns in certificate["spec"]["dnsNames"]
    (service_port,) = service["spec"]["ports"]
    assert service_port["targetPort"] == "https"
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]


def test_both_webhooks_call_the_service_for_podvm_pods_only_and_fail_closed() -> None:
    o = objects("webhook.yaml")
    service = o["Service"]
    certificate = next(d for d in issuers_and_certificates() if d["kind"] == "Certificate"
                       and not d["spec"].get("isCA"))
    served = {r.resource.canonical for r in
              make_app(Policy(config.Config()), Metrics()).router.routes()}
    for kind, path in (("MutatingWebhookConfiguration", "/mutate"),
                       ("ValidatingWebhookConfiguration", "/validate")):
        configuration = o[kind]
        assert configuration["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] \
            == f"{certificate['metadata']['namespace']}/{certificate['metadata']['name']}"
        (hook,) = configuration["webhooks"]
        assert hook["clientConfig"]["service"] == {
            "namespace": service["metadata"]["namespace"],
            "name": service["metadata"]["name"], "path": path,
            "port": service["spec"]["ports"][0]["port"]}
        assert path in served
        assert hook["admissionReviewVersions"] == ["v1"]
        assert hook["failurePolicy"] == "Fail" and hook["sideEffects"] == "None"
        assert 1 <= hook["timeoutSeconds"] <= 10
        (rule,) = hook["rules"]
        assert rule["operations"] == ["CREATE"] and rule["resources"] == ["pods"]
        assert rule["apiGroups"] == [""] and rule["apiVersions"] == ["v1"]
        (condition,) = hook["matchConditions"]
        assert 'object.spec.runtimeClassName == "podvm"' in condition["expression"]
        excluded = hook["namespaceSelector"]["matchExpressions"][0]
        assert excluded["operator"] == "NotIn"
        assert service["metadata"]["namespace"] in excluded["values"]
        assert hook["objectSelector"]["matchExpressions"]


def test_the_configmap_is_the_packaged_node_configuration() -> None:
    text = objects("webhook.yaml")["ConfigMap"]["data"]["configuration.toml"]
    in_cluster = config.parse(tomllib.loads(text), "ConfigMap podvm-config")
    on_nodes = config.load(str(ROOT / "packaging" / "configuration.toml"))
    for key in tomllib.loads(text)["hypervisor"]["qemu"]:
        assert getattr(in_cluster.qemu, key) == getattr(on_nodes.qemu, key), key
    for key in tomllib.loads(text)["runtime"]:
        assert getattr(in_cluster.runtime, key) == getattr(on_nodes.runtime, key), key
