"""A real OTLP trace receiver for tests: gRPC (TraceService/Export) or HTTP (POST /v1/traces,
protobuf body), decoding opentelemetry-proto messages into plain :class:`ReceivedSpan` values.
It can serve TLS with a certificate made by the test (:func:`make_tls`), and it records the request
headers (gRPC metadata) of every export.

OTLP delivery is at least once: an export whose answer was late is sent again. The receiver keeps
one span per (trace id, span id), as a collector's store does, counts the copies it set aside in
``copies`` and lists in ``conflicts`` any copy whose content differs from the span it repeats.

    with OtlpReceiver("grpc") as receiver:
        ... export to receiver.endpoint ...
        wait_until(lambda: len(receiver.snapshot()) >= 3, 10)   # tests.support.wait_until
        spans = receiver.snapshot()

    tls = make_tls(tmp_path)           # a private CA and a server certificate for 127.0.0.1/localhost
    with OtlpReceiver("http", tls=tls) as receiver:   # https://127.0.0.1:PORT/v1/traces
        ... export with OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE=tls.ca ...
        receiver.headers[0]["authorization"]
"""

from __future__ import annotations

import datetime
import gzip
import ipaddress
import ssl
import threading
import zlib
from concurrent import futures
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from tests.support import free_port


@dataclass(frozen=True)
class ReceivedSpan:
    trace_id: str
    span_id: str
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
                    trace_id=span.trace_id.hex(),
                    span_id=span.span_id.hex(),
                    name=span.name,
                    service_name=resource.get("service.name"),
                    kind=int(span.kind),
                    start_ns=int(span.start_time_unix_nano),
                    end_ns=int(span.end_time_unix_nano),
                    attributes={kv.key: _value(kv.value) for kv in span.attributes},
                    status_code=int(span.status.code),
                ))
    return spans


@dataclass(frozen=True)
class TlsFiles:
    """PEM files: the CA that signed the server certificate, and the server's certificate and key."""

    ca: Path
    cert: Path
    key: Path


def make_tls(directory: Path, name: str = "test") -> TlsFiles:
    """A fresh private CA and a server certificate it signed for 127.0.0.1 and localhost."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    start, end = now - datetime.timedelta(hours=1), now + datetime.timedelta(days=2)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"carbonforge {name} test CA")])
    ca_ski = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())
    ca_cert = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(ca_ski, critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
        .issuer_name(ca_name).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                    x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                       critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    files = TlsFiles(directory / f"{name}-ca.pem", directory / f"{name}-server.pem", directory / f"{name}-server.key")
    files.ca.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    files.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    files.key.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                            serialization.NoEncryption()))
    return files


#: How long an export already taken may take to be answered when the receiver stops.
STOP_GRACE_S = 3.0


class OtlpReceiver:
    """One receiver on 127.0.0.1, ``protocol`` "grpc" or "http", over TLS when ``tls`` is given.
    Restartable on the same port. ``headers`` holds, per export, the request headers (HTTP) or
    the metadata (gRPC) it received, names in lower case."""

    def __init__(self, protocol: str, port: int | None = None, tls: TlsFiles | None = None) -> None:
        if protocol not in ("grpc", "http"):
            raise ValueError(protocol)
        self.protocol = protocol
        self.port = port or free_port()
        self.tls = tls
        self.spans: list[ReceivedSpan] = []
        self._by_id: dict[tuple[str, str], ReceivedSpan] = {}
        self.copies = 0
        self.conflicts: list[tuple[ReceivedSpan, ReceivedSpan]] = []
        self.headers: list[dict[str, str]] = []
        self.requests = 0
        self._lock = threading.Lock()
        self._grpc: grpc.Server | None = None
        self._http: ThreadingHTTPServer | None = None
        self._http_thread: threading.Thread | None = None

    @property
    def endpoint(self) -> str:
        scheme = "https" if self.tls else "http"
        if self.protocol == "grpc":
            return f"{scheme}://127.0.0.1:{self.port}"
        return f"{scheme}://127.0.0.1:{self.port}/v1/traces"

    def _store(self, message: trace_service_pb2.ExportTraceServiceRequest, headers: dict[str, str]) -> None:
        spans = decode_request(message)
        with self._lock:
            for span in spans:
                first = self._by_id.setdefault((span.trace_id, span.span_id), span)
                if first is span:
                    self.spans.append(span)
                    continue
                self.copies += 1
                if first != span:
                    self.conflicts.append((first, span))
            self.headers.append(headers)
            self.requests += 1

    def start(self) -> OtlpReceiver:
        if self.protocol == "grpc":
            receiver = self

            class Service(trace_service_pb2_grpc.TraceServiceServicer):
                def Export(self, request: Any, context: Any) -> Any:
                    metadata = {str(k).lower(): str(v) for k, v in context.invocation_metadata()}
                    receiver._store(request, metadata)
                    return trace_service_pb2.ExportTraceServiceResponse()

            server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
            trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), server)
            if self.tls:
                credentials = grpc.ssl_server_credentials([(self.tls.key.read_bytes(), self.tls.cert.read_bytes())])
                server.add_secure_port(f"127.0.0.1:{self.port}", credentials)
            else:
                server.add_insecure_port(f"127.0.0.1:{self.port}")
            server.start()
            self._grpc = server
        else:
            self._http = ThreadingHTTPServer(("127.0.0.1", self.port), self._handler())
            self._http.daemon_threads = True
            self._http.handle_error = lambda request, address: None  # type: ignore[method-assign]
            if self.tls:
                context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
                context.load_cert_chain(self.tls.cert, self.tls.key)
                # the handshake runs in the handler's thread, so a client that gives up never blocks accept()
                self._http.socket = context.wrap_socket(self._http.socket, server_side=True,
                                                        do_handshake_on_connect=False)
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
                receiver._store(message, {k.lower(): v for k, v in self.headers.items()})
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
        """Refuse new exports at once; an export already taken is answered first (a grace of a few
        seconds), as a collector that shuts down does. Without it an export whose spans are stored
        but whose answer is cut off counts as delivered here and, after its retries, as dropped by the
        sink."""
        if self._grpc is not None:
            self._grpc.stop(grace=STOP_GRACE_S).wait(STOP_GRACE_S + 5)
            self._grpc = None
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None

    def snapshot(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self.spans)

    def __enter__(self) -> OtlpReceiver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
