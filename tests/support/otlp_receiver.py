"""A real OTLP trace receiver for tests: gRPC (TraceService/Export) or HTTP (POST /v1/traces,
protobuf body), decoding opentelemetry-proto messages into plain :class:`ReceivedSpan` values.

    with OtlpReceiver("grpc") as receiver:
        ... export to receiver.endpoint ...
        spans = receiver.wait_for(3, timeout_s=10)
"""

from __future__ import annotations

import gzip
import threading
import time
import zlib
from concurrent import futures
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from tests.support import free_port


@dataclass(frozen=True)
class ReceivedSpan:
    name: str
    service_name: str | None
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    status_code: int


def _value(value: AnyValue) -> Any:
    which = value.WhichOneof("value")
    if which == "string_value":
        return value.string_value
    if which == "int_value":
        return int(value.int_value)
    if which == "double_value":
        return float(value.double_value)
    if which == "bool_value":
        return bool(value.bool_value)
    if which == "array_value":
        return [_value(v) for v in value.array_value.values]
    return None


def decode_request(message: trace_service_pb2.ExportTraceServiceRequest) -> list[ReceivedSpan]:
    spans = []
    for resource_spans in message.resource_spans:
        resource = {kv.key: _value(kv.value) for kv in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append(ReceivedSpan(
                    name=span.name,
                    service_name=resource.get("service.name"),
                    kind=int(span.kind),
                    start_ns=int(span.start_time_unix_nano),
                    end_ns=int(span.end_time_unix_nano),
                    attributes={kv.key: _value(kv.value) for kv in span.attributes},
                    status_code=int(span.status.code),
                ))
    return spans


class OtlpReceiver:
    """One receiver on 127.0.0.1, ``protocol`` "grpc" or "http". Restartable on the same port."""

    def __init__(self, protocol: str, port: int | None = None) -> None:
        if protocol not in ("grpc", "http"):
            raise ValueError(protocol)
        self.protocol = protocol
        self.port = port or free_port()
        self.spans: list[ReceivedSpan] = []
        self.requests = 0
        self._lock = threading.Lock()
        self._grpc: grpc.Server | None = None
        self._http: ThreadingHTTPServer | None = None
        self._http_thread: threading.Thread | None = None

    @property
    def endpoint(self) -> str:
        if self.protocol == "grpc":
            return f"http://127.0.0.1:{self.port}"
        return f"http://127.0.0.1:{self.port}/v1/traces"

    def _store(self, message: trace_service_pb2.ExportTraceServiceRequest) -> None:
        spans = decode_request(message)
        with self._lock:
            self.spans.extend(spans)
            self.requests += 1

    def start(self) -> OtlpReceiver:
        if self.protocol == "grpc":
            receiver = self

            class Service(trace_service_pb2_grpc.TraceServiceServicer):
                def Export(self, request: Any, context: Any) -> Any:
                    receiver._store(request)
                    return trace_service_pb2.ExportTraceServiceResponse()

            server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
            trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), server)
            server.add_insecure_port(f"127.0.0.1:{self.port}")
            server.start()
            self._grpc = server
        else:
            self._http = ThreadingHTTPServer(("127.0.0.1", self.port), self._handler())
            self._http.daemon_threads = True
            self._http_thread = threading.Thread(target=self._http.serve_forever, daemon=True)
            self._http_thread.start()
        return self

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                encoding = (self.headers.get("Content-Encoding") or "").lower()
                if encoding == "gzip":
                    body = gzip.decompress(body)
                elif encoding == "deflate":
                    body = zlib.decompress(body)
                if self.path != "/v1/traces" or "protobuf" not in (self.headers.get("Content-Type") or ""):
                    self.send_response(404)
                    self.end_headers()
                    return
                message = trace_service_pb2.ExportTraceServiceRequest()
                message.ParseFromString(body)
                receiver._store(message)
                reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                return

        return Handler

    def stop(self) -> None:
        if self._grpc is not None:
            self._grpc.stop(grace=None).wait(5)
            self._grpc = None
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None

    def snapshot(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self.spans)

    def wait_for(self, count: int, timeout_s: float) -> list[ReceivedSpan]:
        """Spans received so far, waiting up to ``timeout_s`` for at least ``count`` of them."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            spans = self.snapshot()
            if len(spans) >= count:
                return spans
            time.sleep(0.05)
        return self.snapshot()

    def __enter__(self) -> OtlpReceiver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
