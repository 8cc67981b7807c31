"""A CRI (runtime.v1) client over gRPC, for tests and tools only.

No generated gRPC stubs: each call is `channel.unary_unary` on the method's path, with the
request and response classes looked up in the service's descriptor, so protos/generate.py
keeps producing message code only and nothing under shim/ ever depends on grpcio.
"""
from __future__ import annotations

import sys
from typing import Any, Callable, TextIO

import grpc
from google.protobuf import message, text_format

from podvm_core.pb.cri import api_pb2 as cri

RUNTIME = "RuntimeService"
IMAGE = "ImageService"
# crictl's limit: ExecSync output and long lists go past gRPC's 4 MiB default.
MAX_MESSAGE = 16 * 1024 * 1024
# A call's timeout when none is given: the client's (None itself means no deadline).
DEFAULT: Any = object()


class CriError(Exception):
    """A failed call, worded as Go's gRPC errors are (what crictl and containerd print)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details

    def __str__(self) -> str:
        return f"rpc error: code = {go_code_name(self.code)} desc = {self.details}"


def go_code_name(code: grpc.StatusCode) -> str:
    """grpc-go's spelling of a status code (NOT_FOUND -> NotFound, CANCELLED -> Canceled)."""
    if code == grpc.StatusCode.CANCELLED:
        return "Canceled"
    if code == grpc.StatusCode.OK:
        return "OK"
    return "".join(word.capitalize() for word in code.name.split("_"))


def grpc_target(endpoint: str) -> str:
    """crictl's endpoint forms as a gRPC target: unix:///path, a bare /path, tcp://host:port."""
    if endpoint.startswith("unix:///"):
        return endpoint
    if endpoint.startswith("unix://"):  # unix://relative/path
        return "unix:" + endpoint[len("unix://"):]
    if endpoint.startswith("/"):
        return "unix://" + endpoint
    if endpoint.startswith("tcp://"):
        return endpoint[len("tcp://"):]
    raise ValueError(f"endpoint {endpoint!r}: only unix:// and tcp:// endpoints are supported")


class CriClient:
    """Calls RuntimeService and ImageService methods by name.

    `timeout` is the deadline of each call in seconds (crictl's --timeout), None for none.
    With `debug`, every request and response is written there in protobuf text format.
    """

    def __init__(self, runtime_endpoint: str, image_endpoint: str | None = None,
                 timeout: float | None = 2.0, debug: TextIO | None = None) -> None:
        self.endpoints = {RUNTIME: runtime_endpoint, IMAGE: image_endpoint or runtime_endpoint}
        self.timeout = timeout
        self.debug = debug
        self._channels: dict[str, grpc.Channel] = {}

    def runtime(self, method: str, request: message.Message,
                timeout: float | None = DEFAULT) -> message.Message:
        return self.call(RUNTIME, method, request, timeout)

    def image(self, method: str, request: message.Message,
              timeout: float | None = DEFAULT) -> message.Message:
        return self.call(IMAGE, method, request, timeout)

    def call(self, service: str, method: str, request: message.Message,
             timeout: float | None = DEFAULT) -> message.Message:
        """One unary call; without `timeout` the client's deadline, None for none."""
        stub = self._stub(service, method, type(request))
        if self.debug is not None:
            self._trace(f"{method}Request", request)
        deadline = self.timeout if timeout is DEFAULT else timeout
        try:
            response = stub(request, timeout=deadline)
        except grpc.RpcError as exc:
            code, details = exc.code(), exc.details()  # type: ignore[attr-defined]
            if self.debug is not None:
                print(f"DEBU[0000] {method}: {code.name}: {details}", file=self.debug)
            raise CriError(code, details or "") from None
        if self.debug is not None:
            self._trace(f"{method}Response", response)
        return response

    def _stub(self, service: str, method: str,
              request_type: type[message.Message]) -> Callable[..., message.Message]:
        desc = cri.DESCRIPTOR.services_by_name[service].methods_by_name.get(method)
        if desc is None:
            raise ValueError(f"{service} has no method {method} in protos/podvm_core/pb/cri/api.proto")
        if desc.input_type is not request_type.DESCRIPTOR:
            raise TypeError(f"{method} takes {desc.input_type.name}, "
                            f"not {request_type.DESCRIPTOR.name}")
        response_type = getattr(cri, desc.output_type.name)
        return self._channel(service).unary_unary(
            f"/{desc.containing_service.full_name}/{method}",
            request_serializer=request_type.SerializeToString,
            response_deserializer=response_type.FromString)

    def _channel(self, service: str) -> grpc.Channel:
        endpoint = self.endpoints[service]
        if endpoint not in self._channels:
            self._channels[endpoint] = grpc.insecure_channel(
                grpc_target(endpoint),
                options=[("grpc.max_receive_message_length", MAX_MESSAGE),
                         ("grpc.max_send_message_length", MAX_MESSAGE)])
        return self._channels[endpoint]

    def _trace(self, what: str, msg: message.Message) -> None:
        text = text_format.MessageToString(msg, as_one_line=True)
        print(f"DEBU[0000] {what}: {{{text}}}", file=self.debug or sys.stderr)

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()

    def __enter__(self) -> "CriClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
