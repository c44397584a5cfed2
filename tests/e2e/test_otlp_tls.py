"""Trace export that can leave the host: OTLP over TLS with an authentication header, on the real
vLLM CPU engine (tiny recipe), the real openai client, and the real receiver serving a certificate
made here. Two engine sessions:

* gRPC over TLS, the CA in OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE and the header in
  OTEL_EXPORTER_OTLP_TRACES_HEADERS: spans arrive with the header, and its value is in no log, not in
  the dry run, and on no process's command line;
* HTTP/protobuf over TLS with a CA that did not sign the receiver's certificate: serving goes on,
  nothing reaches the receiver, and the shutdown report counts every span as dropped.
"""

from __future__ import annotations

import re
import signal
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from tests.support import REPO, TINY_KEY, TINY_SERVED_NAME, RuntimeProcess, descendants, wait_until
from tests.support.otlp_receiver import OtlpReceiver, TlsFiles, make_tls

#: Holds with a second engine beside it (scripts/test.sh runs these modules two at a time).
pytestmark = pytest.mark.parallel_safe

#: The header's value as the variable carries it (URL-encoded) and as the collector receives it.
TOKEN = "cf-e2e-7d41b9c0a3"
HEADERS = f"authorization=Bearer%20{TOKEN},x-scope-orgid=tenant-42"
RECEIVED = f"Bearer {TOKEN}"


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> tuple[TlsFiles, TlsFiles]:
    base = tmp_path_factory.mktemp("otlp-certs")
    return make_tls(base, "collector"), make_tls(base, "stranger")


def tls_runtime(receiver: OtlpReceiver, log_dir: Path, env: dict[str, str]) -> RuntimeProcess:
    runtime = RuntimeProcess(
        ["--context-key", TINY_KEY, "--request-trace", "standard", "--trace-endpoint", receiver.endpoint,
         "--trace-format", "otlp"],
        log_dir, env=env,
    )
    for name in ("REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE"):  # would replace the OTLP CA file for requests
        runtime.env.pop(name, None)
    return runtime


def ask_all(runtime: RuntimeProcess, count: int) -> list[str]:
    client = openai.OpenAI(base_url=runtime.base_url, api_key="unused", timeout=300, max_retries=0)

    def one(i: int) -> str:
        reply = client.chat.completions.create(
            model=TINY_SERVED_NAME, messages=[{"role": "user", "content": f"invoice {i}"}], max_tokens=4,
            extra_body={"ignore_eos": True},
        )
        assert reply.usage is not None and reply.usage.completion_tokens == 4
        return reply.id

    with ThreadPoolExecutor(max_workers=count) as pool:
        return list(pool.map(one, range(count)))


def assert_secret_absent(text: str, where: str) -> None:
    for form in (TOKEN, HEADERS):
        assert form not in text, f"the header value appears in {where}"


def log_files(log_dir: Path) -> dict[str, str]:
    return {str(p): p.read_text(errors="replace") for p in log_dir.rglob("*") if p.is_file()}


def test_grpc_over_tls_with_a_header_delivers_spans_and_keeps_the_value_private(
    certs: tuple[TlsFiles, TlsFiles], tmp_path: Path,
) -> None:
    collector, _ = certs
    env = {"OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE": str(collector.ca), "OTEL_EXPORTER_OTLP_TRACES_HEADERS": HEADERS}
    with OtlpReceiver("grpc", tls=collector) as receiver:
        runtime = tls_runtime(receiver, tmp_path / "logs", env)

        # the dry run of the same launch: TLS, the CA file and the header names, never the value
        dry = subprocess.run([*runtime.python, *runtime.args, "--dry-run"], capture_output=True, text=True,
                             env=runtime.env, cwd=REPO, timeout=120)
        assert dry.returncode == 0, dry.stderr
        assert f"OTLP export over TLS; the collector's certificate is checked against {collector.ca} " \
               "(OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE)" in dry.stdout
        assert "OTLP headers from OTEL_EXPORTER_OTLP_TRACES_HEADERS: authorization, x-scope-orgid (values hidden)" \
               in dry.stdout
        assert_secret_absent(dry.stdout + dry.stderr, "the dry run")

        runtime.start()
        try:
            runtime.wait_ready()
            assert runtime.proc is not None
            pids = {runtime.proc.pid} | descendants(runtime.proc.pid)
            assert len(pids) >= 3, runtime.describe(pids)  # runtime, API server, engine core
            for pid in pids:
                try:
                    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                except OSError:
                    continue
                assert_secret_absent(cmdline, f"/proc/{pid}/cmdline")

            ids = ask_all(runtime, 6)
            wait_until(lambda: len(receiver.snapshot()) >= 6, 30, every_s=0.05)
            spans = receiver.snapshot()
            assert {s.attributes["cf.request_id"] for s in spans} == set(ids)
            assert all(s.name == "llm_request" and s.service_name == "carbonforge-scheduler" for s in spans)
            assert receiver.headers, "no export reached the receiver"
            for headers in receiver.headers:
                assert headers["authorization"] == RECEIVED and headers["x-scope-orgid"] == "tenant-42"
            assert runtime.stop(signal.SIGTERM, timeout_s=90) == 0, runtime.output()
        finally:
            runtime.kill()
    out = runtime.output()
    assert "request trace: OTLP headers from OTEL_EXPORTER_OTLP_TRACES_HEADERS: authorization, x-scope-orgid " \
           "(values hidden)" in out
    assert "request trace: flushed at shutdown" in runtime.engine_log()
    logs = log_files(tmp_path / "logs")
    assert {"runtime.log", "vllm.log"} <= {Path(p).name for p in logs}
    for path, text in logs.items():
        assert_secret_absent(text, path)


def test_http_over_tls_with_an_untrusted_certificate_serves_and_counts_every_drop(
    certs: tuple[TlsFiles, TlsFiles], tmp_path: Path,
) -> None:
    collector, stranger = certs
    env = {"OTEL_EXPORTER_OTLP_CERTIFICATE": str(stranger.ca), "OTEL_EXPORTER_OTLP_HEADERS": HEADERS}
    with OtlpReceiver("http", tls=collector) as receiver:
        runtime = tls_runtime(receiver, tmp_path / "logs", env).start()
        try:
            runtime.wait_ready()
            ids = ask_all(runtime, 5)
            assert len(set(ids)) == 5  # serving is unaffected by the failing export
            untrusted = r"sink OTLP http/protobuf \S+ failed.*TLS certificate not trusted"
            assert wait_until(lambda: runtime.engine_log_search(untrusted), 60), \
                runtime.engine_log()[-3000:]
            assert runtime.stop(signal.SIGTERM, timeout_s=90) == 0, runtime.output()
        finally:
            runtime.kill()
    log = runtime.engine_log()
    assert "request trace: flushed at shutdown" in log, log[-3000:]
    totals = [int(n) for n in re.findall(r"dropped by sink OTLP http/protobuf \S+ \((\d+) in total", log)]
    assert max(totals, default=0) == 5, log[-3000:]
    assert receiver.requests == 0 and receiver.spans == [] and receiver.headers == []
    for path, text in log_files(tmp_path / "logs").items():
        assert_secret_absent(text, path)
