"""The real podvm-webhook process with a certificate made by openssl, and a client that
talks to it over verified HTTPS the way the API server does."""
from __future__ import annotations

import base64
import json
import os
import pathlib
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from typing import Any

from .prereqs import require_tool

ROOT = pathlib.Path(__file__).resolve().parents[1]
POD_KIND = {"group": "", "version": "v1", "kind": "Pod"}
REALTIME_PRIORITY = 10


def make_certificate(directory: pathlib.Path, name: str, days: int = 1
                     ) -> tuple[pathlib.Path, pathlib.Path]:
    """A self-signed certificate for localhost and 127.0.0.1 (CN = `name`) and its key."""
    openssl = require_tool("openssl", "openssl")
    directory.mkdir(parents=True, exist_ok=True)
    cert, key = directory / f"{name}.crt", directory / f"{name}.key"
    subprocess.run([openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", str(days), "-subj", f"/CN={name}", "-addext",
                    "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    return cert, key


def install(source: pathlib.Path, target: pathlib.Path) -> None:
    """Replace `target` in one step, as a Secret volume's update does."""
    tmp = target.with_suffix(target.suffix + ".new")
    tmp.write_bytes(source.read_bytes())
    os.replace(tmp, target)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Answer:
    status: int
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def response(self) -> dict:
        """The AdmissionReview's response, checked to be one."""
        review = self.json()
        assert self.status == 200, self.body
        assert review["apiVersion"] == "admission.k8s.io/v1"
        assert review["kind"] == "AdmissionReview"
        return review["response"]


class Webhook:
    def __init__(self, workdir: pathlib.Path, config: str) -> None:
        self.workdir = workdir
        self.cert, self.key = workdir / "tls.crt", workdir / "tls.key"
        first_cert, first_key = make_certificate(workdir / "made", "first")
        install(first_cert, self.cert)
        install(first_key, self.key)
        self.trusted = [first_cert]
        self.config = workdir / "configuration.toml"
        self.config.write_text(config)
        self.port = free_port()
        self.log = workdir / "webhook.log"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 30, cpus: set[int] | None = None,
              realtime: bool = False) -> "Webhook":
        """`cpus`: the only CPUs the server may run on; `realtime`: SCHED_FIFO."""
        def confine() -> None:
            if cpus is not None:
                os.sched_setaffinity(0, cpus)
            if realtime:
                os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(REALTIME_PRIORITY))

        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "podvm_webhook.cli", "--cert", str(self.cert), "--key",
                 str(self.key), "--config", str(self.config), "--address", "127.0.0.1",
                 "--port", str(self.port), "--reload-interval", "0.2"],
                cwd=ROOT, stdout=log, stderr=log,
                preexec_fn=confine if cpus is not None or realtime else None)
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.get("/readyz").status == 200:
                    return self
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"podvm-webhook did not get ready: {self.log_text()}")
            time.sleep(0.1)

    def stop(self) -> int:
        """SIGTERM, as the kubelet stops it; its exit status."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def client_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context()
        for cert in self.trusted:
            context.load_verify_locations(cafile=str(cert))
        return context

    def request(self, method: str, path: str, body: bytes | None = None,
                timeout: float = 10) -> Answer:
        req = urllib.request.Request(f"https://localhost:{self.port}{path}", data=body,
                                     method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, context=self.client_context(),
                                        timeout=timeout) as r:
                return Answer(r.status, r.read())
        except urllib.error.HTTPError as exc:
            return Answer(exc.code, exc.read())

    def get(self, path: str) -> Answer:
        return self.request("GET", path)

    def review(self, endpoint: str, pod: Any, **request: Any) -> Answer:
        return self.request("POST", f"/{endpoint}", json.dumps(review(pod, **request)).encode())

    def served_certificate_cn(self) -> str:
        """The CN of the certificate a new connection gets (trusting any)."""
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        with socket.create_connection(("127.0.0.1", self.port), timeout=10) as sock:
            with context.wrap_socket(sock, server_hostname="localhost") as tls:
                der = tls.getpeercert(binary_form=True)
        text = subprocess.run(["openssl", "x509", "-inform", "DER", "-noout", "-subject"],
                              input=der, capture_output=True, check=True, timeout=30).stdout
        return text.decode().strip().rsplit("=", 1)[-1].strip()


def review(pod: Any, uid: str | None = None, kind: dict | None = None,
           operation: str = "CREATE") -> dict:
    """An AdmissionReview as the API server sends it for a pod's creation."""
    metadata = pod.get("metadata", {}) if isinstance(pod, dict) else {}
    return {
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {
            "uid": str(uuid.uuid4()) if uid is None else uid,
            "kind": kind or POD_KIND,
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "requestKind": kind or POD_KIND,
            "requestResource": {"group": "", "version": "v1", "resource": "pods"},
            "name": metadata.get("name", ""), "namespace": "default",
            "operation": operation,
            "userInfo": {"username": "kubernetes-admin", "groups": ["system:masters"]},
            "object": pod, "oldObject": None, "dryRun": False,
            "options": {"kind": "CreateOptions", "apiVersion": "meta.k8s.io/v1"}}}


def pod(*containers: dict, runtime_class: str | None = "podvm", overhead: dict | None = None,
        annotations: dict | None = None, name: str = "web") -> dict:
    """A Pod as the API server has it at admission: defaulted, spec.overhead set by the
    RuntimeClass plugin."""
    spec: dict = {"containers": list(containers), "restartPolicy": "Always",
                  "dnsPolicy": "ClusterFirst", "schedulerName": "default-scheduler"}
    if runtime_class is not None:
        spec["runtimeClassName"] = runtime_class
    if overhead is not None:
        spec["overhead"] = overhead
    metadata: dict = {"name": name, "namespace": "default", "labels": {"app": name}}
    if annotations is not None:
        metadata["annotations"] = annotations
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec}


def container(name: str = "app", cpu: str | None = None, memory: str | None = None,
              requests: dict | None = None) -> dict:
    """Limits as given; requests equal to them (as the API server defaults them) unless
    given."""
    limits = {k: v for k, v in (("cpu", cpu), ("memory", memory)) if v is not None}
    return {"name": name, "image": "busybox", "imagePullPolicy": "IfNotPresent",
            "resources": {"limits": limits, "requests": {**limits, **(requests or {})}}}


def decoded_patch(response: dict) -> list[dict]:
    assert response["patchType"] == "JSONPatch"
    return json.loads(base64.b64decode(response["patch"]))


def apply_patch(document: dict, patch: list[dict]) -> dict:
    """RFC 6902 `add` operations, paths read as RFC 6901 pointers: what the API server
    does with the webhook's patch."""
    document = json.loads(json.dumps(document))
    for op in patch:
        assert op["op"] == "add", op
        tokens = [t.replace("~1", "/").replace("~0", "~") for t in op["path"].split("/")[1:]]
        parent = document
        for token in tokens[:-1]:
            parent = parent[token]
        parent[tokens[-1]] = op["value"]
    return document
