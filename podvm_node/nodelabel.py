"""The node's podvm.io/runtime label, through the Kubernetes API with the pod's service
account (the RuntimeClass schedules podvm pods onto nodes that have it: see
packaging/kubernetes/). Outside a cluster there is no node to label: said, not failed."""
from __future__ import annotations

import json
import os
import re
import ssl
import urllib.error
import urllib.request

LABEL = "podvm.io/runtime"
VALUE = "installed"
ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
NODE_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")
"""A node's name is a DNS subdomain (RFC 1123): nothing else goes into the request's path."""


class LabelError(RuntimeError):
    pass


def set_label(value: str | None, env: dict[str, str] | None = None,
              account: str = ACCOUNT) -> str:
    """Label the node NODE_NAME (downward API) with `value`, or remove the label (None);
    returns the line to print."""
    env = dict(os.environ) if env is None else env
    host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT", "443")
    node = env.get("NODE_NAME")
    if not host or not os.path.exists(os.path.join(account, "token")):
        return "not in a Kubernetes cluster: no node to label"
    if not node:
        raise LabelError("NODE_NAME is not set (the DaemonSet passes spec.nodeName)")
    if not NODE_NAME.fullmatch(node):
        raise LabelError(f"NODE_NAME {node!r} is not a node name (a DNS subdomain)")
    with open(os.path.join(account, "token")) as f:
        token = f.read().strip()
    context = ssl.create_default_context(cafile=os.path.join(account, "ca.crt"))
    body = json.dumps({"metadata": {"labels": {LABEL: value}}}).encode()
    url = f"https://{host if ':' not in host else '[' + host + ']'}:{port}/api/v1/nodes/{node}"
    request = urllib.request.Request(url, data=body, method="PATCH", headers={
        "Authorization": f"Bearer {token}", "Content-Type": "application/merge-patch+json"})
    try:
        with urllib.request.urlopen(request, context=context, timeout=30):
            pass
    except (urllib.error.URLError, OSError) as exc:
        raise LabelError(f"labelling node {node}: {exc}") from None
    return f"node {node}: " + (f"labelled {LABEL}={value}" if value else f"{LABEL} removed")
