"""The request-trace flags of ``serve``, validated into the engine contract's trace part.

:func:`resolve_trace_options` turns the four tracing flags (plus the standard OpenTelemetry
protocol variables) into a :class:`~carbonforge_runtime.core.contract.TraceConfig` or ``None`` and
a list of warnings, raising :class:`~carbonforge_runtime.errors.UsageError` for combinations that
cannot work.

TLS and headers for the export are the OpenTelemetry SDK's own variables (``OTEL_EXPORTER_OTLP_*``),
read by the SDK in the engine process, which inherits them. This module only explains to the operator
what the SDK will do with them (:func:`export_security`), and refuses before launch what would fail
in the engine without a useful message: a CA or client file that cannot be read, or a header
variable the SDK would reject (it would log the whole entry, value included).
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit, urlunsplit

from carbonforge_runtime import files
from carbonforge_runtime.core.contract import PROTOCOL_GRPC, PROTOCOL_HTTP, PROTOCOLS, OtlpTarget, TraceConfig
from carbonforge_runtime.core.redaction import redact_url
from carbonforge_runtime.core.trace_record import LEVEL_OFF, LEVELS
from carbonforge_runtime.errors import UsageError

FORMAT_OTLP = "otlp"
FORMATS = (FORMAT_OTLP,)
#: Standard OpenTelemetry variables that pick the OTLP transport (the first one set wins).
PROTOCOL_VARS = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
OTLP_HTTP_PATH = "/v1/traces"
OTLP_GRPC_PORT = 4317
OTLP_HTTP_PORT = 4318


@dataclass
class TraceDecision:
    config: TraceConfig | None
    warnings: list[str] = field(default_factory=list)
    #: How the export is secured (TLS, CA file, header names), for the log and the dry run.
    notes: list[str] = field(default_factory=list)


def otlp_sdk_missing() -> list[str]:
    """Modules the OTLP sink needs that are not importable here."""
    wanted = (
        "opentelemetry.sdk.trace",
        "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
        "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    )
    missing = []
    for name in wanted:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(name)
    return missing


def otlp_target(endpoint: str, environ: Mapping[str, str]) -> OtlpTarget:
    """Normalise the collector URL and pick the transport.

    An OpenTelemetry protocol variable wins; otherwise a URL whose path is ``/v1/traces`` or whose
    port is 4318 means HTTP/protobuf, anything else gRPC.
    """
    text = endpoint.strip()
    parts = urlsplit(text if "://" in text else f"http://{text}")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UsageError(
            f"--trace-endpoint {redact_url(endpoint)!r} is not a collector URL",
            "give the OTLP collector as http://HOST:4317 (gRPC) or http://HOST:4318 (HTTP/protobuf)",
        )
    try:
        port = parts.port
    except ValueError:
        raise UsageError(
            f"--trace-endpoint {redact_url(endpoint)!r} has an invalid port",
            "give the OTLP collector as http://HOST:4317 (gRPC) or http://HOST:4318 (HTTP/protobuf)",
        ) from None
    protocol = None
    for var in PROTOCOL_VARS:
        value = environ.get(var, "").strip().lower()
        if value:
            if value not in PROTOCOLS:
                raise UsageError(
                    f"{var}={value!r} is not an OTLP protocol this runtime exports",
                    f"set {var} to grpc or http/protobuf, or unset it to choose by the URL",
                )
            protocol = value
            break
    path = parts.path.rstrip("/")
    if protocol is None:
        protocol = PROTOCOL_HTTP if (path == OTLP_HTTP_PATH or port == OTLP_HTTP_PORT) else PROTOCOL_GRPC
    if protocol == PROTOCOL_HTTP:
        path = path or OTLP_HTTP_PATH
        url = urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))
    else:
        netloc = parts.netloc if port is not None else f"{parts.netloc}:{OTLP_GRPC_PORT}"
        url = urlunsplit((parts.scheme, netloc, "", "", ""))
    return OtlpTarget(url, protocol)


# ---- TLS and headers: what the OpenTelemetry SDK will read in the engine -------------------------------

#: The SDK's variables, the traces-only one first: when it is set, the general one is not read.
CERTIFICATE_VARS = ("OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE", "OTEL_EXPORTER_OTLP_CERTIFICATE")
CLIENT_CERTIFICATE_VARS = ("OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE", "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE")
CLIENT_KEY_VARS = ("OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY", "OTEL_EXPORTER_OTLP_CLIENT_KEY")
HEADERS_VARS = ("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "OTEL_EXPORTER_OTLP_HEADERS")
INSECURE_VARS = ("OTEL_EXPORTER_OTLP_TRACES_INSECURE", "OTEL_EXPORTER_OTLP_INSECURE")
#: Variables with which ``requests`` (the HTTP exporter's client) replaces the CA file it was given.
REQUESTS_CA_VARS = ("REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE")

# The header grammar the SDK accepts (W3C baggage style, plus unencoded spaces in values).
_HEADER_NAME = r"[\x21\x23-\x27\x2a\x2b\x2d\x2e\x30-\x39\x41-\x5a\x5e-\x7a\x7c\x7e]+"
_HEADER_VALUE = r"[\x20\x21\x23-\x2b\x2d-\x3a\x3c-\x5b\x5d-\x7e]*"
_HEADER_ENTRY = re.compile(rf"[ \t]*({_HEADER_NAME})[ \t]*=[ \t]*({_HEADER_VALUE})[ \t]*")
_HEADER_SPLIT = re.compile(r"[ \t]*,[ \t]*")
_HEADER_FORMAT = ("write it as name=value pairs separated by commas, with special characters in values "
                  "URL-encoded (e.g. authorization=Bearer%20TOKEN)")


@dataclass(frozen=True)
class TlsFile:
    """A file the exporter will read for TLS, and the variable that names it."""

    role: str  # "CA certificate", "client certificate" or "client key"
    variable: str
    path: str


@dataclass(frozen=True)
class ExportSecurity:
    """What the SDK's exporter will do with the ``OTEL_EXPORTER_OTLP_*`` variables for one target."""

    tls: bool
    ca: TlsFile | None = None
    client: tuple[TlsFile, ...] = ()
    headers_variable: str | None = None
    header_names: tuple[str, ...] = ()
    #: TLS variables that are set but that this exporter will not read.
    unused: tuple[str, ...] = ()

    @property
    def files(self) -> tuple[TlsFile, ...]:
        return ((self.ca,) if self.ca else ()) + self.client


def _first_set(names: tuple[str, ...], environ: Mapping[str, str]) -> tuple[str, str] | None:
    """The first variable with a non-empty value (the SDK's ``a or b`` precedence)."""
    for name in names:
        if environ.get(name):
            return name, environ[name]
    return None


def otlp_header_names(variable: str, text: str) -> tuple[str, ...]:
    """The header names in ``text`` as the SDK parses them (lower case, URL-decoded). An entry the SDK
    would reject, or a value no transport can send, is a :class:`UsageError` that never shows a value."""
    names: list[str] = []
    for position, entry in enumerate(_HEADER_SPLIT.split(text), start=1):
        if not entry.strip():
            continue
        match = _HEADER_ENTRY.fullmatch(entry)
        if match is None:
            raise UsageError(f"{variable}: entry {position} is not a valid name=value header (value not shown)",
                             _HEADER_FORMAT)
        name = unquote(match.group(1)).strip().lower()
        value = unquote(match.group(2)).strip()
        if not all(" " <= ch <= "~" or ch == "\t" for ch in value):
            raise UsageError(f"{variable}: the value of header {name!r} is not printable ASCII once decoded",
                             "headers can carry printable ASCII only; encode binary or non-ASCII tokens "
                             "(e.g. base64) before URL-encoding them")
        if name not in names:
            names.append(name)
    return tuple(names)


def export_security(target: OtlpTarget, environ: Mapping[str, str]) -> ExportSecurity:
    """How the SDK's exporter for ``target`` will secure the export, from the same variables it reads.

    gRPC: an ``https://`` URL is always TLS; an ``http://`` one is plain unless an ``*_INSECURE``
    variable (the traces one first) says anything but ``true``. The CA file is the traces variable
    when that is set, else the general one; a client certificate and key are read only from the same
    pair as that CA file. HTTP: TLS exactly for ``https://``; each file falls back to the general
    variable on its own, and a client key is used only together with a client certificate.
    """
    scheme = urlsplit(target.endpoint).scheme
    headers = _first_set(HEADERS_VARS, environ)
    header_names = otlp_header_names(*headers) if headers else ()
    files: list[TlsFile] = []
    if target.protocol == PROTOCOL_GRPC:
        tls = scheme == "https"
        if not tls:
            for name in INSECURE_VARS:
                if name in environ:
                    tls = environ[name].lower() != "true"
                    break
        # The traces-only files count when that CA variable is present (even empty) and the traces-only
        # insecure variable is not "true"; otherwise the SDK falls back to the general variables.
        traces_plain = environ.get(INSECURE_VARS[0], "").lower() == "true"
        family = 0 if CERTIFICATE_VARS[0] in environ and not traces_plain else 1
        ca_path = environ.get(CERTIFICATE_VARS[family], "")
        if ca_path:
            files.append(TlsFile("CA certificate", CERTIFICATE_VARS[family], ca_path))
            for role, names in (("client certificate", CLIENT_CERTIFICATE_VARS), ("client key", CLIENT_KEY_VARS)):
                if environ.get(names[family]):
                    files.append(TlsFile(role, names[family], environ[names[family]]))
    else:
        tls = scheme == "https"
        ca = _first_set(CERTIFICATE_VARS, environ)
        if ca:
            files.append(TlsFile("CA certificate", *ca))
        cert = _first_set(CLIENT_CERTIFICATE_VARS, environ)
        if cert:
            files.append(TlsFile("client certificate", *cert))
            key = _first_set(CLIENT_KEY_VARS, environ)
            if key:
                files.append(TlsFile("client key", *key))
    if not tls:
        files = []
    used = {f.variable for f in files}
    unused = tuple(name for name in (*CERTIFICATE_VARS, *CLIENT_CERTIFICATE_VARS, *CLIENT_KEY_VARS)
                   if environ.get(name) and name not in used)
    ca_file = next((f for f in files if f.role == "CA certificate"), None)
    return ExportSecurity(tls, ca_file, tuple(f for f in files if f is not ca_file),
                          headers[0] if headers else None, header_names, unused)


def _read_head(path: str) -> bytes:
    return files.read_regular(path, (1 << 20) - 1)


def check_tls_files(security: ExportSecurity, cwd: str | None = None,
                    read: Callable[[str], bytes] = _read_head) -> None:
    """Refuse, before launch, a TLS file the exporter could not use: missing, unreadable, not PEM."""
    for item in security.files:
        path = os.path.join(cwd or os.getcwd(), os.path.expanduser(item.path))
        fix = (f"point {item.variable} at the {item.role} in PEM form, in a file the runtime's user can read, "
               f"or unset {item.variable}")
        if item.role == "CA certificate":
            fix += " to check the collector against the default trust store"
        try:
            head = read(path)
        except FileNotFoundError:
            raise UsageError(f"{item.variable} names {item.path}, which does not exist", fix) from None
        except files.NotRegularFile as exc:
            raise UsageError(f"{item.variable} names {item.path}, which is {exc.strerror}", fix) from None
        except OSError as exc:
            raise UsageError(f"{item.variable} names {item.path}, which cannot be read "
                             f"({exc.strerror or exc})", fix) from None
        marker = b"PRIVATE KEY-----" if item.role == "client key" else b"-----BEGIN CERTIFICATE-----"
        if marker not in head:
            raise UsageError(f"{item.variable} names {item.path}, which holds no PEM "
                             f"{'private key' if item.role == 'client key' else 'certificate'}", fix)


def describe_security(target: OtlpTarget, security: ExportSecurity) -> list[str]:
    """One line per fact, for the log and the dry run. Header values are never part of it."""
    lines = []
    if not security.tls:
        lines.append("OTLP export without TLS (plain http://)")
    elif security.ca is not None:
        lines.append(f"OTLP export over TLS; the collector's certificate is checked against "
                     f"{security.ca.path} ({security.ca.variable})")
    else:
        default = ("requests' certifi bundle, or REQUESTS_CA_BUNDLE" if target.protocol == PROTOCOL_HTTP
                   else "grpcio's bundled root certificates, or GRPC_DEFAULT_SSL_ROOTS_FILE_PATH")
        lines.append(f"OTLP export over TLS; no CA variable is set, so the collector's certificate is checked "
                     f"against the default trust store ({default})")
    for item in security.client:
        lines.append(f"OTLP {item.role}: {item.path} ({item.variable})")
    if security.headers_variable:
        names = ", ".join(security.header_names) or "none"
        lines.append(f"OTLP headers from {security.headers_variable}: {names} (values hidden)")
    return lines


def security_warnings(target: OtlpTarget, security: ExportSecurity, environ: Mapping[str, str]) -> list[str]:
    where = redact_url(target.endpoint)
    warnings = []
    if security.header_names and not security.tls:
        warnings.append(f"{security.headers_variable} sets OTLP headers, but the export to {where} is not "
                        "encrypted, so their values cross the network in clear text: use an https:// endpoint")
    if security.unused:
        why = ("the export is not encrypted (use an https:// endpoint)" if not security.tls else
               "the gRPC exporter reads a client certificate and key only next to the CA variable in use"
               if target.protocol == PROTOCOL_GRPC else "a client key is used only with a client certificate")
        warnings.append(f"{', '.join(security.unused)} set but not used for {where}: {why}")
    if security.ca is not None and target.protocol == PROTOCOL_HTTP:
        for name in REQUESTS_CA_VARS:
            if environ.get(name):
                warnings.append(f"{name} is set: the HTTP exporter checks the collector against it instead of "
                                f"{security.ca.variable}; unset {name} in the serving environment")
                break
    return warnings


def trace_export_lines(trace: TraceConfig | None, environ: Mapping[str, str]) -> list[str]:
    """The dry run's account of how the export is secured (empty without an OTLP sink)."""
    if trace is None or trace.otlp is None:
        return []
    return describe_security(trace.otlp, export_security(trace.otlp, environ))


def resolve_trace_options(
    level: str | None,
    trace_file: str | None,
    endpoint: str | None,
    trace_format: str | None,
    environ: Mapping[str, str],
    cwd: str | None = None,
) -> TraceDecision:
    """Validate the tracing flags. A sink without a level is an error; a level without a sink
    is a warning and tracing stays off."""
    level = (level or LEVEL_OFF).strip().lower()
    if level not in LEVELS:
        raise UsageError(
            f"--request-trace {level!r} is not a trace level",
            "use --request-trace off, standard or full",
        )
    fmt = trace_format.strip().lower() if trace_format else None
    if fmt is not None and fmt not in FORMATS:
        raise UsageError(
            f"--trace-format {trace_format!r} is not supported",
            "use --trace-format otlp (the only export format) with --trace-endpoint",
        )
    if fmt is not None and not endpoint:
        raise UsageError(
            "--trace-format is set but --trace-endpoint is not",
            "add --trace-endpoint http://COLLECTOR:4317, or drop --trace-format",
        )
    if trace_file is not None and not trace_file.strip():
        raise UsageError("--trace-file is empty",
                         "give a file path, e.g. --trace-file /var/log/carbonforge/traces.jsonl")
    sinks = [name for name, given in (("--trace-file", trace_file), ("--trace-endpoint", endpoint)) if given]
    if level == LEVEL_OFF:
        if sinks:
            raise UsageError(
                f"{' and '.join(sinks)} given but --request-trace is off",
                "add --request-trace standard (or full) to write traces, or remove the sink flags",
            )
        return TraceDecision(None)
    if not sinks:
        return TraceDecision(None, [
            f"--request-trace {level} has no sink, so tracing stays off (serving continues): add "
            "--trace-file PATH and/or --trace-endpoint URL --trace-format otlp"
        ])
    warnings: list[str] = []
    path = None
    if trace_file:
        path = os.path.abspath(os.path.join(cwd or os.getcwd(), os.path.expanduser(trace_file.strip())))
    target = otlp_target(endpoint, environ) if endpoint else None
    notes: list[str] = []
    if target is not None:
        security = export_security(target, environ)
        check_tls_files(security, cwd)
        notes = describe_security(target, security)
        warnings += security_warnings(target, security, environ)
        missing = otlp_sdk_missing()
        if missing:
            warnings.append(
                "the OpenTelemetry SDK is not installed (" + ", ".join(missing) + "): every span for "
                f"{redact_url(target.endpoint)} will be dropped and counted; install opentelemetry-sdk and "
                "opentelemetry-exporter-otlp into the serving environment"
            )
    return TraceDecision(TraceConfig(level=level, file=path, otlp=target), warnings, notes)
