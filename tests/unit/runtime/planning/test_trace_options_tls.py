"""TLS and headers for the OTLP export: how the runtime reads the SDK's OTEL_EXPORTER_OTLP_* variables,
what it refuses before launch, and what the dry run says (header values never)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from carbonforge_runtime.errors import UsageError
from carbonforge_runtime.runtime.planning.trace_options import (
    ExportSecurity,
    check_tls_files,
    export_security,
    otlp_header_names,
    otlp_target,
    resolve_trace_options,
)
from tests.support import TINY_KEY
from tests.support.otlp_receiver import make_tls

REPO = Path(__file__).resolve().parents[4]
SECRET = "s3cr3t-Token-4f9a"


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    return make_tls(tmp_path_factory.mktemp("tls"))


def grpc(url: str = "https://c:4317"):  # type: ignore[no-untyped-def]
    return otlp_target(url, {})


def http(url: str = "https://c:4318"):  # type: ignore[no-untyped-def]
    return otlp_target(url, {})


# ---- which variables the SDK's exporter reads ------------------------------------------------------------


def test_https_is_tls_and_the_traces_ca_wins_over_the_general_one() -> None:
    env = {"OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE": "/t/ca.pem", "OTEL_EXPORTER_OTLP_CERTIFICATE": "/g/ca.pem"}
    for target in (grpc(), http()):
        security = export_security(target, env)
        assert security.tls
        assert security.ca is not None and (security.ca.variable, security.ca.path) == \
            ("OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE", "/t/ca.pem")
        assert security.unused == ("OTEL_EXPORTER_OTLP_CERTIFICATE",)


def test_plain_http_reads_no_tls_file_and_says_so() -> None:
    env = {"OTEL_EXPORTER_OTLP_CERTIFICATE": "/g/ca.pem"}
    for target in (grpc("http://c:4317"), http("http://c:4318")):
        security = export_security(target, env)
        assert not security.tls and security.files == ()
        assert security.unused == ("OTEL_EXPORTER_OTLP_CERTIFICATE",)


@pytest.mark.parametrize(("env", "tls"), [
    ({}, False),
    ({"OTEL_EXPORTER_OTLP_INSECURE": "false"}, True),
    ({"OTEL_EXPORTER_OTLP_INSECURE": "true"}, False),
    ({"OTEL_EXPORTER_OTLP_TRACES_INSECURE": "false", "OTEL_EXPORTER_OTLP_INSECURE": "true"}, True),
])
def test_grpc_over_http_follows_the_insecure_variables(env: dict[str, str], tls: bool) -> None:
    assert export_security(grpc("http://c:4317"), env).tls is tls


def test_insecure_never_turns_off_tls_for_https() -> None:
    assert export_security(grpc(), {"OTEL_EXPORTER_OTLP_INSECURE": "true"}).tls


def test_grpc_reads_the_client_pair_only_next_to_its_ca_variable() -> None:
    env = {"OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE": "/t/ca.pem",
           "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE": "/g/client.pem", "OTEL_EXPORTER_OTLP_CLIENT_KEY": "/g/client.key"}
    grpc_security = export_security(grpc(), env)
    assert grpc_security.client == ()
    assert set(grpc_security.unused) == {"OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE", "OTEL_EXPORTER_OTLP_CLIENT_KEY"}
    # the HTTP exporter falls back file by file
    http_security = export_security(http(), env)
    assert [(f.role, f.path) for f in http_security.client] == [("client certificate", "/g/client.pem"),
                                                                ("client key", "/g/client.key")]
    assert http_security.unused == ()


def test_headers_come_from_the_traces_variable_first_and_only_names_are_kept() -> None:
    env = {"OTEL_EXPORTER_OTLP_TRACES_HEADERS": f"Authorization=Bearer%20{SECRET}, X-Scope-OrgID=acme",
           "OTEL_EXPORTER_OTLP_HEADERS": "other=1"}
    security = export_security(grpc(), env)
    assert security.headers_variable == "OTEL_EXPORTER_OTLP_TRACES_HEADERS"
    assert security.header_names == ("authorization", "x-scope-orgid")
    assert SECRET not in repr(security)


@pytest.mark.parametrize("text", [f"authorization {SECRET}", f"authorization=Bearer {SECRET},bad{SECRET}",
                                  f"x=1,=v{SECRET}", f'auth="{SECRET}"'])
def test_a_malformed_header_entry_is_refused_without_its_value(text: str) -> None:
    with pytest.raises(UsageError) as caught:
        otlp_header_names("OTEL_EXPORTER_OTLP_HEADERS", text)
    rendered = caught.value.render()
    assert "OTEL_EXPORTER_OTLP_HEADERS" in rendered and "name=value" in rendered
    assert SECRET not in rendered


def test_a_header_value_that_is_not_ascii_once_decoded_is_refused() -> None:
    with pytest.raises(UsageError, match="'authorization' is not printable ASCII"):
        otlp_header_names("OTEL_EXPORTER_OTLP_HEADERS", "authorization=caf%C3%A9")


def test_spaces_and_empty_entries_are_what_the_sdk_accepts() -> None:
    assert otlp_header_names("V", " a = Bearer x , , b=%2Fy ") == ("a", "b")


# ---- files refused before launch ---------------------------------------------------------------------


def test_the_shipped_kind_of_ca_file_passes(tls) -> None:  # type: ignore[no-untyped-def]
    env = {"OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE": str(tls.ca)}
    check_tls_files(export_security(grpc(), env))


@pytest.mark.parametrize(("make", "fragment"), [
    (lambda d: d / "missing.pem", "which does not exist"),
    (lambda d: d, "which is a directory"),
    (lambda d: (d / "der.pem", (d / "der.pem").write_bytes(b"\x30\x82\x01\x0a"))[0], "which holds no PEM certificate"),
])
def test_an_unusable_ca_file_is_a_usage_error_naming_the_variable(tmp_path: Path, make, fragment: str) -> None:  # type: ignore[no-untyped-def]
    path = make(tmp_path)
    env = {"OTEL_EXPORTER_OTLP_CERTIFICATE": str(path)}
    with pytest.raises(UsageError) as caught:
        resolve_trace_options("standard", None, "https://collector:4317", "otlp", env)
    error = caught.value
    assert error.exit_code == 2
    assert error.message.startswith(f"OTEL_EXPORTER_OTLP_CERTIFICATE names {path}, {fragment}")
    assert "point OTEL_EXPORTER_OTLP_CERTIFICATE at the CA certificate" in error.remedy
    assert "default trust store" in error.remedy


def test_an_unreadable_file_reports_the_os_reason() -> None:
    def denied(path: str) -> bytes:
        raise PermissionError(13, "Permission denied", path)

    security = ExportSecurity(True, export_security(grpc(), {"OTEL_EXPORTER_OTLP_CERTIFICATE": "/x"}).ca)
    with pytest.raises(UsageError, match=r"names /x, which cannot be read \(Permission denied\)"):
        check_tls_files(security, read=denied)


def test_a_client_key_that_is_not_a_key_is_refused(tls) -> None:  # type: ignore[no-untyped-def]
    env = {"OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE": str(tls.ca),
           "OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE": str(tls.cert),
           "OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY": str(tls.cert)}
    with pytest.raises(UsageError, match=r"OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY names .* holds no PEM private key"):
        resolve_trace_options("standard", None, "https://collector:4317", "otlp", env)
    env["OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY"] = str(tls.key)
    notes = resolve_trace_options("standard", None, "https://collector:4317", "otlp", env).notes
    assert f"OTLP client key: {tls.key} (OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY)" in notes


def test_a_missing_ca_file_is_not_checked_when_no_tls_uses_it() -> None:
    env = {"OTEL_EXPORTER_OTLP_CERTIFICATE": "/nowhere/ca.pem"}
    decision = resolve_trace_options("standard", None, "http://collector:4317", "otlp", env)
    assert any("OTEL_EXPORTER_OTLP_CERTIFICATE set but not used" in w for w in decision.warnings)


# ---- notes and warnings ------------------------------------------------------------------------------


def test_notes_say_tls_ca_and_header_names_but_never_values(tls) -> None:  # type: ignore[no-untyped-def]
    env = {"OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE": str(tls.ca),
           "OTEL_EXPORTER_OTLP_HEADERS": f"authorization=Bearer%20{SECRET}"}
    decision = resolve_trace_options("standard", None, "https://collector:4318", "otlp", env)
    assert decision.notes == [
        f"OTLP export over TLS; the collector's certificate is checked against {tls.ca} "
        "(OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE)",
        "OTLP headers from OTEL_EXPORTER_OTLP_HEADERS: authorization (values hidden)",
    ]
    assert decision.warnings == []
    assert SECRET not in repr(decision)


def test_https_without_a_ca_variable_uses_the_default_trust_store() -> None:
    notes = resolve_trace_options("standard", None, "https://collector:4317", "otlp", {}).notes
    assert notes == ["OTLP export over TLS; no CA variable is set, so the collector's certificate is checked "
                     "against the default trust store (grpcio's bundled root certificates, or "
                     "GRPC_DEFAULT_SSL_ROOTS_FILE_PATH)"]


def test_headers_over_plain_http_are_a_warning() -> None:
    decision = resolve_trace_options("standard", None, "http://collector:4318", "otlp",
                                     {"OTEL_EXPORTER_OTLP_HEADERS": f"authorization={SECRET}"})
    assert decision.notes[0] == "OTLP export without TLS (plain http://)"
    assert any("clear text" in w and "https://" in w for w in decision.warnings)
    assert SECRET not in repr(decision)


def test_requests_ca_bundle_that_would_replace_the_ca_file_is_a_warning(tls) -> None:  # type: ignore[no-untyped-def]
    env = {"OTEL_EXPORTER_OTLP_CERTIFICATE": str(tls.ca), "REQUESTS_CA_BUNDLE": "/etc/ssl/bundle.pem"}
    http_warnings = resolve_trace_options("standard", None, "https://c:4318", "otlp", env).warnings
    assert any(w.startswith("REQUESTS_CA_BUNDLE is set: the HTTP exporter checks the collector against it")
               for w in http_warnings)
    assert resolve_trace_options("standard", None, "https://c:4317", "otlp", env).warnings == []  # gRPC


# ---- the dry run -----------------------------------------------------------------------------------


def dry_run(endpoint: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    full.update(env)
    return subprocess.run(
        [sys.executable, "-m", "carbonforge_runtime", "--context-key", TINY_KEY, "--request-trace", "standard",
         "--trace-endpoint", endpoint, "--dry-run"],
        capture_output=True, text=True, env=full, cwd=REPO, timeout=120,
    )


def test_dry_run_names_the_ca_file_and_header_names_but_hides_values(tls) -> None:  # type: ignore[no-untyped-def]
    done = dry_run("https://collector.example:4317", {
        "OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE": str(tls.ca),
        "OTEL_EXPORTER_OTLP_TRACES_HEADERS": f"authorization=Bearer%20{SECRET},x-tenant=acme",
    })
    assert done.returncode == 0, done.stderr
    assert f"trace export:       OTLP export over TLS; the collector's certificate is checked against {tls.ca}" \
           in done.stdout
    assert "trace export:       OTLP headers from OTEL_EXPORTER_OTLP_TRACES_HEADERS: authorization, x-tenant " \
           "(values hidden)" in done.stdout
    assert SECRET not in done.stdout + done.stderr


def test_dry_run_fails_on_a_missing_ca_file_with_the_fix(tmp_path: Path) -> None:
    missing = {"OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE": str(tmp_path / "no.pem")}
    done = dry_run("https://collector.example:4317", missing)
    assert done.returncode == 2
    assert f"error: OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE names {tmp_path / 'no.pem'}, which does not exist" \
           in done.stderr
    assert "fix: point OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE at the CA certificate" in done.stderr
    assert "Traceback" not in done.stderr
