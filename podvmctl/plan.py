"""podvmctl plan: the pods of a manifest as the admission webhook will judge them (the same
policy, the same configuration file), printed with the plan's reasons, for a user at a
terminal before `kubectl apply`.

A manifest holds Pods, or workloads with a pod template (Deployment, StatefulSet,
DaemonSet, ReplicaSet, Job), and may hold the RuntimeClass too: as the API server's
RuntimeClass admission plugin does, its overhead.podFixed becomes the pod's spec.overhead."""
from __future__ import annotations

import copy
import dataclasses
import json
from typing import Any, Iterable

from podvm_webhook.policy import Policy, Verdict, admit


class ManifestError(ValueError):
    pass


def read_documents(path: str) -> list[dict]:
    """Every object in a YAML or JSON file (`---`-separated YAML; a List's items)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ManifestError(f"{path}: cannot read: {exc.strerror}") from None
    if path.endswith(".json"):
        try:
            documents = [json.loads(text)]
        except ValueError as exc:
            raise ManifestError(f"{path}: not valid JSON: {exc}") from None
    else:
        import yaml  # only this command reads YAML

        try:
            documents = list(yaml.safe_load_all(text))
        except yaml.YAMLError as exc:
            raise ManifestError(f"{path}: not valid YAML: {exc}") from None
    found: list[dict] = []
    for document in documents:
        if document is None:
            continue
        if not isinstance(document, dict):
            raise ManifestError(f"{path}: a document is not a Kubernetes object")
        items = document.get("items") if document.get("kind", "").endswith("List") else None
        found.extend(items if isinstance(items, list) else [document])
    return found


def pods_of(documents: Iterable[dict]) -> list[tuple[str, dict]]:
    """(what it is, the pod) for every pod the documents make."""
    pods = []
    for obj in documents:
        kind = obj.get("kind", "")
        name = (obj.get("metadata") or {}).get("name", "")
        if kind == "Pod":
            pods.append((f"Pod {name}", obj))
        elif isinstance((obj.get("spec") or {}).get("template"), dict):
            template = obj["spec"]["template"]
            pods.append((f"{kind} {name} (its pod template)",
                         {"apiVersion": "v1", "kind": "Pod", **template}))
    return pods


def with_runtime_class_overhead(pod: dict, documents: Iterable[dict]) -> dict:
    """The pod as the RuntimeClass admission plugin leaves it: spec.overhead from its
    RuntimeClass's overhead.podFixed, when the documents hold that RuntimeClass."""
    spec = pod.get("spec")
    if not isinstance(spec, dict):
        return pod
    for obj in documents:
        if obj.get("kind") == "RuntimeClass" and \
                (obj.get("metadata") or {}).get("name") == spec.get("runtimeClassName"):
            fixed = (obj.get("overhead") or {}).get("podFixed")
            if fixed and spec.get("overhead") not in (None, fixed):
                raise ManifestError(f"the pod's spec.overhead {spec['overhead']} differs from "
                                    f"RuntimeClass {obj['metadata']['name']}'s "
                                    f"overhead.podFixed {fixed}: the API server refuses it")
            if fixed:
                pod = copy.deepcopy(pod)
                pod["spec"]["overhead"] = fixed
    return pod


def plan_manifest(paths: list[str], policy: Policy) -> list[tuple[str, Verdict]]:
    documents = [d for path in paths for d in read_documents(path)]
    pods = pods_of(documents)
    if not pods:
        raise ManifestError(f"{', '.join(paths)}: no Pod and no pod template")
    return [(what, admit(with_runtime_class_overhead(pod, documents), policy))
            for what, pod in pods]


def render(what: str, verdict: Verdict, policy: Policy) -> str:
    if not verdict.podvm:
        return (f"{what}: not a podvm pod (runtime classes "
                f"{', '.join(sorted(policy.runtime_classes))}): admitted as it is\n")
    lines = [f"{what}: " + ("ADMITTED" if verdict.allowed else "REFUSED")]
    plan = verdict.plan
    if plan is not None:
        lines.append(f"  VM: {plan.vcpus} vCPUs, {plan.memory_mib} MiB" + (
                     f", a {plan.disk_mib} MiB scratch disk" if plan.disk_mib else "") +
                     f"; the RuntimeClass "
                     f"overhead it needs: memory {plan.overhead_memory_mib}Mi, cpu "
                     f"{plan.overhead_cpu_millis}m")
    lines += [f"  refused: {reason}" for reason in verdict.reasons]
    lines += [f"  warning: {warning}" for warning in verdict.warnings]
    lines += [f"  annotation: {key}={value}" for key, value in verdict.annotations.items()]
    lines += ["  why:"] + [f"    {line}" for line in verdict.explanation]
    return "\n".join(lines) + "\n"


def as_json(what: str, verdict: Verdict) -> dict[str, Any]:
    return {"object": what, **dataclasses.asdict(verdict)}
