"""The request-trace flags of ``serve``, validated into the engine contract's trace part.

:func:`resolve_trace_options` turns the four tracing flags (plus the standard OpenTelemetry
protocol variables) into a :class:`~carbonforge_runtime.core.contract.TraceConfig` or ``None`` and
a list of warnings, raising :class:`~carbonforge_runtime.errors.UsageError` for combinations that
cannot work.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

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
    if target is not None:
        missing = otlp_sdk_missing()
        if missing:
            warnings.append(
                "the OpenTelemetry SDK is not installed (" + ", ".join(missing) + "): every span for "
                f"{redact_url(target.endpoint)} will be dropped and counted; install opentelemetry-sdk and "
                "opentelemetry-exporter-otlp into the serving environment"
            )
    return TraceDecision(TraceConfig(level=level, file=path, otlp=target), warnings)
