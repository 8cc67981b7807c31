"""The real podvm-webhook stopped by SIGTERM, as the kubelet stops it, while its clients
hold connections open the way the API server does (keep-alive, left idle), or worse (a
request half sent, a reader that does not read): it stops being ready at once and exits 0
within a few seconds, well inside a Deployment's grace period (30 s)."""
from __future__ import annotations

import asyncio
import http.client
import json
import signal
import socket
import ssl
import time

import pytest
from aiohttp.test_utils import make_mocked_request

from podvm_webhook.metrics import Metrics
from podvm_webhook.policy import Policy
from podvm_webhook.server import STOPPING, _ready, make_app
from shim.config import Config

from testbed.webhook import Webhook, container, pod, review
from tests.podvm_webhook.conftest import STATIC_CONFIG

EXIT_BOUND = 5.0
"""Seconds from SIGTERM to exit; the server's own grace for requests in flight is 1 s."""


def _tls(webhook: Webhook, rcvbuf: int | None = None) -> ssl.SSLSocket:
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(10)
    sock.connect(("127.0.0.1", webhook.port))
    return webhook.client_context().wrap_socket(sock, server_hostname="localhost")


def _keep_alive(webhook: Webhook, body: bytes) -> http.client.HTTPSConnection:
    """A connection that served a request and is left open, idle."""
    conn = http.client.HTTPSConnection("localhost", webhook.port, timeout=10,
                                       context=webhook.client_context())
    conn.request("POST", "/validate", body, {"Content-Type": "application/json"})
    conn.getresponse().read()
    return conn


def _half_sent(webhook: Webhook) -> ssl.SSLSocket:
    """A request whose headers promise a body that never comes in full."""
    tls = _tls(webhook)
    tls.sendall(b"POST /mutate HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json"
                b"\r\nContent-Length: 100000\r\n\r\n{\"apiVersion\":")
    return tls


def _slow_reader(webhook: Webhook) -> ssl.SSLSocket:
    """Many pipelined requests whose answers are never read: the server's writes block."""
    tls = _tls(webhook, rcvbuf=4096)
    request = b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n"
    tls.settimeout(0.5)
    try:
        for _ in range(4000):
            tls.sendall(request)
    except (socket.timeout, ssl.SSLError, OSError):
        pass  # the server stopped reading: its writes to us are blocked
    return tls


def _ready_after_sigterm(webhook: Webhook) -> int | None:
    """The readiness probe's status on a new connection; None when refused."""
    try:
        return webhook.request("GET", "/readyz", timeout=2).status
    except OSError:
        return None


@pytest.mark.parametrize("attempt", range(3))
def test_sigterm_with_connections_held_open_exits_promptly(tmp_path, attempt) -> None:
    webhook = Webhook(tmp_path, STATIC_CONFIG).start()
    held: list = []
    try:
        good = json.dumps(review(pod(container(cpu="1", memory="64Mi"),
                                     overhead={"cpu": "1", "memory": "448Mi"}))).encode()
        for body in (good, b"not json", good, b"{}"):
            held.append(_keep_alive(webhook, body))
        held.append(_half_sent(webhook))
        held.append(_slow_reader(webhook))
        held.append(_tls(webhook))  # connected, never sends a request
        time.sleep(0.2)
        assert webhook.alive(), webhook.log_text()

        webhook.proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        time.sleep(0.3)
        assert _ready_after_sigterm(webhook) in (None, 503), webhook.log_text()
        try:
            status = webhook.proc.wait(timeout=EXIT_BOUND - (time.monotonic() - sent))
        except Exception:
            raise AssertionError(f"podvm-webhook still running {EXIT_BOUND} s after SIGTERM: "
                                 f"{webhook.log_text()}")
        assert status == 0, webhook.log_text()
        assert "msg=stopping" in webhook.log_text()
    finally:
        for conn in held:
            conn.close()
        webhook.stop()


def test_readiness_says_not_ready_once_stopping() -> None:
    """A probe that reaches the server between SIGTERM and the listening socket's close (or
    on a connection still open) is answered 503."""
    stop = asyncio.Event()
    app = make_app(Policy(Config(), frozenset({"podvm"})), Metrics())
    app[STOPPING] = stop
    ready = asyncio.run(_ready(make_mocked_request("GET", "/readyz", app=app)))
    assert ready.status == 200
    stop.set()
    assert asyncio.run(_ready(make_mocked_request("GET", "/readyz", app=app))).status == 503
