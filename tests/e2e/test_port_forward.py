"""`kubectl port-forward` to a VM pod, through containerd's CRI (Debian's 1.6): containerd
dials localhost:PORT in the pod's network namespace on the host, where podvm's nat rule
and listener carry the connection to the guest agent, which connects to the port inside
the pod. The pod's server listens on 127.0.0.1 only, so nothing but port-forward reaches
it. The client is crictl's `port-forward` (ours speaks the streaming server's websocket
protocol; CRICTL=/path/to/crictl runs the real one, SPDY).

Real containerd, QEMU under TCG and the guest image."""
from __future__ import annotations

import socket
import time

import pytest

from testbed.cri import PortForward, write_config
from testbed.pods import container_config, pod_config

from .test_podvm_pods import configs, crictl, ctd, remove_pod  # noqa: F401

PAGE = "forwarded from the VM pod"
PORT = 8080
SERVE = (f"mkdir -p /www && echo '{PAGE}' > /www/index.html && "
         f"exec httpd -f -p 127.0.0.1:{PORT} -h /www")


def http_get(port: int, timeout: float = 60) -> bytes:
    """One HTTP/1.0 request on a fresh connection; everything until the server closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(b"GET /index.html HTTP/1.0\r\nHost: pod\r\n\r\n")
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


@pytest.fixture(scope="module")
def web_pod(ctd, crictl, configs):  # noqa: F811
    pod_file = write_config(configs, "pod-forward.json", pod_config(ctd, configs, "forward"))
    pod_id = crictl.runp(pod_file, runtime="podvm")
    try:
        cid = crictl.create(pod_id, write_config(configs, "forward-c.json",
                                                 container_config("web", SERVE)), pod_file)
        crictl.start(cid)
        deadline = time.monotonic() + 60
        while True:  # httpd is up when the pod itself can fetch the page
            got = crictl.exec(cid, "wget", "-q", "-O-", f"http://127.0.0.1:{PORT}/index.html")
            if got.exit_code == 0 and PAGE in got.stdout:
                break
            assert time.monotonic() < deadline, f"httpd in the pod never answered: {got}"
            time.sleep(0.5)
        yield {"id": pod_id, "container": cid}
    finally:
        remove_pod(crictl, pod_id)


def test_port_forward_reaches_a_server_on_the_pod_s_loopback(crictl, web_pod,  # noqa: F811
                                                             configs) -> None:  # noqa: F811
    pod_ip = crictl.inspectp(web_pod["id"])["status"]["network"]["ip"]
    assert pod_ip
    with pytest.raises(OSError):  # only on the pod's loopback: not reachable from outside
        socket.create_connection((pod_ip, PORT), timeout=5).close()
    with PortForward(crictl, web_pod["id"], PORT, configs) as forward:
        for _ in range(2):  # a second request, on a fresh connection
            response = http_get(forward.local_port)
            assert response.startswith(b"HTTP/1.") and b" 200 " in response.split(b"\r\n")[0], \
                response[:200]
            assert response.rstrip().endswith(PAGE.encode()), response[-200:]
        assert "error" not in forward.errors().lower(), forward.errors()


def test_port_forward_to_a_port_nobody_listens_on_fails_at_once(crictl, web_pod,  # noqa: F811
                                                                configs) -> None:  # noqa: F811
    with PortForward(crictl, web_pod["id"], PORT + 1, configs) as forward:
        started = time.monotonic()
        with socket.create_connection(("127.0.0.1", forward.local_port), timeout=60) as sock:
            sock.sendall(b"GET / HTTP/1.0\r\n\r\n")
            try:
                assert sock.recv(65536) == b""  # closed, nothing forwarded: not a hang
            except ConnectionResetError:
                pass
        assert time.monotonic() - started < 30
        deadline = time.monotonic() + 10
        while f"port {PORT + 1}" not in forward.errors() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert f"error forwarding port {PORT + 1}" in forward.errors(), forward.errors()
        # the forward still serves the port that answers once the pod listens: a
        # failed connection does not end it
        assert forward.process.poll() is None


def test_stopping_the_pod_ends_an_open_forward(crictl, web_pod, configs) -> None:  # noqa: F811
    """Last: it stops the module's pod. A connection the pod's server still holds open
    (half a request) ends when the pod stops, and the stop does not wait on it."""
    with PortForward(crictl, web_pod["id"], PORT, configs) as forward:
        with socket.create_connection(("127.0.0.1", forward.local_port), timeout=60) as sock:
            sock.sendall(b"GET /index.html HTTP/1.0\r\n")  # no blank line: httpd waits
            time.sleep(2)  # the forward reaches the guest
            started = time.monotonic()
            crictl.run("stopp", web_pod["id"])
            try:
                assert sock.recv(65536) == b""
            except ConnectionResetError:
                pass
        assert time.monotonic() - started < 60
