"""The installer's one Kubernetes API call, against a loopback HTTPS server that plays the
API server (no cluster runs here): the PATCH it sends, and what it refuses. The token must
reach only a server the service account's CA vouches for."""
from __future__ import annotations

import json
import pathlib
import ssl
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from podvm_node import nodelabel
from testbed.webhook import make_certificate

TOKEN = "secret-token-of-the-installer"


class ApiServer:
    """Answers every PATCH with `status` and records what it was sent."""

    def __init__(self, cert: pathlib.Path, key: pathlib.Path, status: int = 200) -> None:
        self.requests: list[dict] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_PATCH(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                server.requests.append({"path": self.path, "headers": dict(self.headers),
                                        "body": json.loads(body)})
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args) -> None:
                pass

        self.httpd = HTTPServer(("127.0.0.1", 0), Handler)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
        self.httpd.socket = context.wrap_socket(self.httpd.socket, server_side=True)
        self.thread = threading.Thread(target=self.httpd.serve_forever,
                                       kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> dict[str, tuple[pathlib.Path, pathlib.Path]]:
    d = tmp_path_factory.mktemp("certs")
    return {name: make_certificate(d, name) for name in ("apiserver", "impostor")}


def account(tmp_path: pathlib.Path, ca: pathlib.Path) -> str:
    d = tmp_path / "serviceaccount"
    d.mkdir()
    (d / "token").write_text(TOKEN + "\n")
    (d / "ca.crt").write_bytes(ca.read_bytes())
    return str(d)


def env(port: int, node: str = "node-a") -> dict[str, str]:
    return {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(port),
            "NODE_NAME": node}


@pytest.fixture
def api(certs):
    server = ApiServer(*certs["apiserver"])
    yield server
    server.close()


def test_labels_and_unlabels_the_node_with_a_merge_patch(api, certs, tmp_path) -> None:
    sa = account(tmp_path, certs["apiserver"][0])
    said = nodelabel.set_label(nodelabel.VALUE, env=env(api.port), account=sa)
    assert said == f"node node-a: labelled {nodelabel.LABEL}={nodelabel.VALUE}"
    said = nodelabel.set_label(None, env=env(api.port), account=sa)
    assert said == f"node node-a: {nodelabel.LABEL} removed"
    assert [r["path"] for r in api.requests] == ["/api/v1/nodes/node-a"] * 2
    for r in api.requests:
        assert r["headers"]["Authorization"] == f"Bearer {TOKEN}"
        assert r["headers"]["Content-Type"] == "application/merge-patch+json"
    assert [r["body"] for r in api.requests] == [
        {"metadata": {"labels": {nodelabel.LABEL: nodelabel.VALUE}}},
        {"metadata": {"labels": {nodelabel.LABEL: None}}}]  # null removes it (RFC 7386)


def test_a_server_the_account_s_ca_does_not_vouch_for_never_sees_the_token(
        certs, tmp_path) -> None:
    impostor = ApiServer(*certs["impostor"])
    try:
        sa = account(tmp_path, certs["apiserver"][0])
        with pytest.raises(nodelabel.LabelError, match="labelling node node-a:.*CERTIFICATE"):
            nodelabel.set_label(nodelabel.VALUE, env=env(impostor.port), account=sa)
        assert impostor.requests == []
    finally:
        impostor.close()


def test_the_api_server_s_refusal_is_an_error_naming_it(certs, tmp_path) -> None:
    """A ClusterRole without patch on nodes: 403, and the install says so."""
    forbidding = ApiServer(*certs["apiserver"], status=403)
    try:
        sa = account(tmp_path, certs["apiserver"][0])
        with pytest.raises(nodelabel.LabelError, match="labelling node node-a: .*403"):
            nodelabel.set_label(nodelabel.VALUE, env=env(forbidding.port), account=sa)
        assert len(forbidding.requests) == 1
    finally:
        forbidding.close()


@pytest.mark.parametrize("node", ["../namespaces/kube-system/secrets/x", "node-a?dryRun=All",
                                  "Node-A", "a" * 254, ""])
def test_a_node_name_that_is_not_one_sends_nothing(api, certs, tmp_path, node) -> None:
    sa = account(tmp_path, certs["apiserver"][0])
    with pytest.raises(nodelabel.LabelError, match="NODE_NAME"):
        nodelabel.set_label(nodelabel.VALUE, env=env(api.port, node), account=sa)
    assert api.requests == []
