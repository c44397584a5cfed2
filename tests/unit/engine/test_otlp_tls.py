"""The OTLP sink over TLS with headers, against the real receiver serving a certificate made here.
The SDK reads the OTEL_EXPORTER_OTLP_* variables itself; these tests show the sink leaves them in force."""

from __future__ import annotations

from pathlib import Path

import pytest

from carbonforge_runtime.core.trace_record import Completion, build_record
from carbonforge_runtime.engine.trace_sinks import OtlpSink, SinkError
from carbonforge_runtime.runtime.planning.trace_options import otlp_target
from tests.support import wait_until
from tests.support.otlp_receiver import OtlpReceiver, TlsFiles, make_tls

SECRET = "Bearer%20tok-91c2e7"


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> tuple[TlsFiles, TlsFiles]:
    base = tmp_path_factory.mktemp("otlp-tls")
    return make_tls(base, "collector"), make_tls(base, "stranger")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # requests would check the collector against these instead of the OTLP CA file (the runtime warns).
    for name in ("REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE"):
        monkeypatch.delenv(name, raising=False)
    for name in ("CERTIFICATE", "HEADERS", "INSECURE", "CLIENT_KEY", "CLIENT_CERTIFICATE"):
        monkeypatch.delenv(f"OTEL_EXPORTER_OTLP_{name}", raising=False)
        monkeypatch.delenv(f"OTEL_EXPORTER_OTLP_TRACES_{name}", raising=False)


def records(n: int) -> list[dict[str, object]]:
    return [build_record(Completion(engine_request_id=f"chatcmpl-t{i}-0123abcd", t_arrival=1000.0,
                                    t_scheduled=1000.25, t_first_token=1000.5, t_completion=1002.0,
                                    prompt_tokens=30, output_tokens=8, finish_reason="length"), "fcfs", "standard")
            for i in range(n)]


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_tls_export_with_headers_from_the_environment(protocol: str, certs: tuple[TlsFiles, TlsFiles],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    collector, _ = certs
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE", str(collector.ca))
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", f"authorization={SECRET},x-tenant=acme")
    with OtlpReceiver(protocol, tls=collector) as receiver:
        assert receiver.endpoint.startswith("https://")
        sink = OtlpSink(otlp_target(receiver.endpoint, {}), timeout_s=5)
        sink.write(records(3))
        sink.close()
        wait_until(lambda: len(receiver.snapshot()) >= 3, 10, every_s=0.05)
        spans = receiver.snapshot()
    assert sorted(s.attributes["cf.request_id"] for s in spans) == ["chatcmpl-t0", "chatcmpl-t1", "chatcmpl-t2"]
    assert receiver.headers and all(h["authorization"] == "Bearer tok-91c2e7" for h in receiver.headers)
    assert receiver.headers[0]["x-tenant"] == "acme"


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_a_collector_signed_by_another_ca_is_a_failed_write(protocol: str, certs: tuple[TlsFiles, TlsFiles],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    collector, stranger = certs
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_CERTIFICATE", str(stranger.ca))
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_HEADERS", f"authorization={SECRET}")
    with OtlpReceiver(protocol, tls=collector) as receiver:
        sink = OtlpSink(otlp_target(receiver.endpoint, {}), timeout_s=1)
        with pytest.raises(SinkError, match="TLS certificate not trusted") as caught:
            sink.write(records(1))
        sink.close()
    assert receiver.requests == 0 and receiver.headers == []  # nothing, headers included, left over TLS
    assert "tok-91c2e7" not in str(caught.value)


def test_grpc_over_an_http_url_turns_tls_on_when_the_sdk_variable_says_so(
    certs: tuple[TlsFiles, TlsFiles], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The sink passes no ``insecure`` of its own: OTEL_EXPORTER_OTLP_INSECURE=false is obeyed."""
    collector, _ = certs
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_INSECURE", "false")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_CERTIFICATE", str(collector.ca))
    with OtlpReceiver("grpc", tls=collector) as receiver:
        sink = OtlpSink(otlp_target(f"http://127.0.0.1:{receiver.port}", {}), timeout_s=5)
        sink.write(records(2))
        sink.close()
        wait_until(lambda: len(receiver.snapshot()) >= 2, 10, every_s=0.05)
        assert len(receiver.snapshot()) == 2


def test_make_tls_writes_a_ca_and_a_server_pair(tmp_path: Path) -> None:
    files = make_tls(tmp_path, "x")
    assert files.ca.read_bytes().startswith(b"-----BEGIN CERTIFICATE-----")
    assert files.cert.read_bytes().startswith(b"-----BEGIN CERTIFICATE-----")
    assert b"PRIVATE KEY-----" in files.key.read_bytes()
