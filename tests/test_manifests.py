"""packaging/kubernetes/ as the API server would take it: every object valid against the
Kubernetes API's own schemas (kubernetes-validate, strict: an unknown or misspelt field
is refused) for the version docs/install.md names; kustomization.yaml lists exactly the
manifests beside it; the node DaemonSet runs podvm-node's own commands with arguments
they take, on the ports and paths the monitor serves; the RuntimeClass schedules onto the
label the installer sets."""
from __future__ import annotations

import copy
import pathlib
import re

import kubernetes_validate
import pytest
import yaml

from podvm_core import trees
from podvm_node import cli as node_cli
from podvm_node import monitor, treecollect
from podvm_node.containerd_dropin import PODVM_CONFIG
from podvm_node.nodelabel import LABEL, VALUE
from shim import config

ROOT = pathlib.Path(__file__).resolve().parents[1]
KUBERNETES = ROOT / "packaging" / "kubernetes"
VERSION = "1.30"
"""The Kubernetes version the manifests are validated against (docs/install.md says so)."""
CUSTOM = {("cert-manager.io/v1", "Issuer"), ("cert-manager.io/v1", "Certificate")}
"""cert-manager's kinds: no schema of Kubernetes' own (cert-manager validates them)."""
INSTALLED_LABEL = (LABEL, VALUE)
"""What `podvm-node install` labels its node with."""


def manifests() -> list[pathlib.Path]:
    return sorted(p for p in KUBERNETES.rglob("*.yaml") if p.name != "kustomization.yaml")


def documents(path: pathlib.Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def every_object() -> dict[tuple[str, str], dict]:
    """By (kind, name) across every manifest: each named once."""
    found: dict[tuple[str, str], dict] = {}
    for path in manifests():
        for doc in documents(path):
            key = (doc["kind"], doc["metadata"]["name"])
            assert key not in found, f"{key} defined twice"
            found[key] = doc
    return found


@pytest.mark.parametrize("path", manifests(), ids=lambda p: str(p.relative_to(KUBERNETES)))
def test_every_object_is_valid_for_the_kubernetes_api(path: pathlib.Path) -> None:
    for doc in documents(path):
        if (doc["apiVersion"], doc["kind"]) in CUSTOM:
            with pytest.raises(kubernetes_validate.SchemaNotFoundError):
                kubernetes_validate.validate(doc, VERSION, strict=True)
            assert doc["metadata"]["name"] and doc["spec"]
            continue
        assert kubernetes_validate.validate(doc, VERSION, strict=True) == VERSION


def test_the_validation_refuses_what_the_api_server_would() -> None:
    """The check above can fail: a misspelt field, a wrong type, a missing handler."""
    daemonset = every_object()[("DaemonSet", "podvm-node")]
    misspelt = copy.deepcopy(daemonset)
    misspelt["spec"]["template"]["spec"]["containers"][0]["imagePolicy"] = "Always"
    wrong_type = copy.deepcopy(daemonset)
    wrong_type["spec"]["template"]["spec"]["hostPID"] = "yes"
    runtime_class = copy.deepcopy(every_object()[("RuntimeClass", "podvm")])
    del runtime_class["handler"]
    for bad in (misspelt, wrong_type, runtime_class):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(bad, VERSION, strict=True)


def test_the_install_guide_names_the_version_validated() -> None:
    assert re.search(rf"validated against\s+Kubernetes\s+{re.escape(VERSION)}\b",
                     (ROOT / "docs" / "install.md").read_text())


def test_the_kustomization_lists_every_manifest_beside_it() -> None:
    kustomization = yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())
    assert kustomization["kind"] == "Kustomization"
    resources = kustomization["resources"]
    assert len(resources) == len(set(resources))
    beside = {p.name for p in KUBERNETES.glob("*.yaml") if p.name != "kustomization.yaml"}
    assert set(resources) == beside
    # what `kubectl delete -k` leaves for a node that could not uninstall: not applied
    assert all(p.parent == KUBERNETES / "cleanup" for p in manifests()
               if p.name not in beside)
    used = {re.sub(r":.*", "", c["image"]) for doc in every_object().values()
            for c in _containers(doc)}
    assert {i["name"] for i in kustomization["images"]} == used == {"podvm-node",
                                                                      "podvm-webhook"}
    namespaces = {d["metadata"]["name"] for (k, _), d in every_object().items()
                  if k == "Namespace"}
    assert {d["metadata"]["namespace"] for d in every_object().values()
            if "namespace" in d["metadata"]} <= namespaces


def test_the_runtime_class_schedules_where_the_installer_has_been() -> None:
    runtime_class = every_object()[("RuntimeClass", "podvm")]
    assert runtime_class["scheduling"]["nodeSelector"] == dict([INSTALLED_LABEL])
    daemonset = every_object()[("DaemonSet", "podvm-node")]
    assert INSTALLED_LABEL[0] not in daemonset["spec"]["template"]["spec"]["nodeSelector"]


def test_the_daemonset_runs_podvm_node_as_it_takes_its_arguments() -> None:
    objects = every_object()
    daemonset = objects[("DaemonSet", "podvm-node")]
    assert daemonset["spec"]["updateStrategy"]["type"] == "RollingUpdate"
    template = daemonset["spec"]["template"]
    pod = template["spec"]
    assert pod["nodeSelector"] == {"podvm.io/node": "true"} and pod["tolerations"]
    (install,) = pod["initContainers"]
    containers = {c["name"]: c for c in pod["containers"]}
    assert install["command"][:2] == ["podvm-node", "install"]
    assert set(containers) == {"monitor", "trees"}
    assert {install["command"][1], "monitor", "trees"} <= set(node_cli.COMMANDS)
    for c in [install, *pod["containers"]]:
        assert c["image"] == "podvm-node:0.1.0"
        assert c["resources"]["requests"] and c["resources"]["limits"]["memory"]
    watch = containers["monitor"]
    args = monitor.parser().parse_args(watch["command"][2:])
    _, port = monitor.listen_address(args.listen)
    ports = {p["name"]: p["containerPort"] for p in watch["ports"]}
    assert ports["metrics"] == port == int(template["metadata"]["annotations"]
                                           ["prometheus.io/port"])
    assert template["metadata"]["annotations"]["prometheus.io/path"] == "/metrics"
    for probe in ("readinessProbe", "livenessProbe"):
        assert watch[probe]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    # the monitor only reads: no privilege, the host's paths read-only
    assert "privileged" not in watch["securityContext"]
    assert watch["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert all(m["readOnly"] for m in watch["volumeMounts"])
    mounted = {m["mountPath"] for m in watch["volumeMounts"]}
    # what it reads: the shims' state, their cgroups and threads, the configuration the
    # installer points containerd at (for the template store)
    assert args.config == "" and PODVM_CONFIG == config.DEFAULT_PATH  # found by default
    for path in (args.state_root, "/proc", "/sys/fs/cgroup", PODVM_CONFIG):
        host_path = args.host_root + path
        assert any(host_path == m or host_path.startswith(m + "/") for m in mounted), path


def test_the_tree_collector_writes_the_host_s_opt_podvm_only() -> None:
    """`podvm-node trees` as the DaemonSet runs it: arguments it takes, the host's
    /opt/podvm where treegc looks for it, nothing else of the host, and the one
    capability it needs to see a jailed QEMU's maps."""
    daemonset = every_object()[("DaemonSet", "podvm-node")]
    pod = daemonset["spec"]["template"]["spec"]
    trees_container = next(c for c in pod["containers"] if c["name"] == "trees")
    command = trees_container["command"]
    assert command[:2] == ["podvm-node", "trees"]
    args = treecollect.parser().parse_args(command[2:])
    assert not args.once and args.every > 0
    (mount,) = trees_container["volumeMounts"]
    assert mount["mountPath"] == args.host_root + trees.PREFIX and not mount.get("readOnly")
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert volume["hostPath"]["path"] == trees.PREFIX
    assert pod["hostPID"] is True  # the host's processes, whose maps it reads
    context = trees_container["securityContext"]
    assert "privileged" not in context and context["readOnlyRootFilesystem"]
    assert context["capabilities"] == {"drop": ["ALL"], "add": ["SYS_PTRACE"]}


def test_the_node_service_account_may_label_nodes_and_nothing_more() -> None:
    objects = every_object()
    (rule,) = objects[("ClusterRole", "podvm-node")]["rules"]
    assert rule == {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]}
    binding = objects[("ClusterRoleBinding", "podvm-node")]
    (subject,) = binding["subjects"]
    daemonset = objects[("DaemonSet", "podvm-node")]
    assert subject == {"kind": "ServiceAccount", "name": "podvm-node",
                       "namespace": daemonset["metadata"]["namespace"]}
    assert daemonset["spec"]["template"]["spec"]["serviceAccountName"] == "podvm-node"
    job = objects[("Job", "podvm-node-cleanup-NODE_NAME")]
    (uninstall,) = job["spec"]["template"]["spec"]["containers"]
    assert uninstall["command"] == ["podvm-node", "uninstall", "--host-root=/host"]
    assert "uninstall" in node_cli.COMMANDS
    assert uninstall["image"] == "podvm-node:0.1.0"


def test_nothing_in_the_node_daemonset_uninstalls() -> None:
    """A rolling update of the DaemonSet (an upgrade) or its pod's restart must not take
    podvm off the node: the next version installs over the running one (its pods keep
    their own trees), and uninstalling is cleanup/'s Job only. No command, argument,
    hook or probe of node.yaml says `uninstall`."""
    assert list(_uninstalls(documents(KUBERNETES / "node.yaml"))) == []
    job = documents(KUBERNETES / "cleanup" / "node-cleanup.yaml")
    assert list(_uninstalls(job)), "the check finds an uninstall where there is one"


def _uninstalls(node: object, where: str = ""):
    """Where in `node` (parsed YAML) a string says `uninstall`."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _uninstalls(value, f"{where}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _uninstalls(value, f"{where}[{i}]")
    elif isinstance(node, str) and "uninstall" in node:
        yield where


def _containers(doc: dict) -> list[dict]:
    spec = doc.get("spec") or {}
    pod = (spec.get("template") or {}).get("spec") or {}
    return pod.get("containers", []) + pod.get("initContainers", [])
