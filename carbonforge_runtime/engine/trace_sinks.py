"""Where records go. Every sink has the same small interface, and :func:`build_sinks` is the one
place that turns the engine contract into sinks: a new kind of sink is one class and one line.

Sinks are called only from their own writer thread (see ``writer.py``), never on the engine loop.
A ``write`` either stores the whole batch or raises: :class:`SinkError` for a failure worth
retrying (the writer backs off and tries again), :class:`PermanentSinkError` for one that no
retry can fix (the batch is dropped and counted at once).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import stat
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from carbonforge_runtime import files
from carbonforge_runtime.core.contract import PROTOCOL_GRPC, MetricsFeed, OtlpTarget, TraceConfig
from carbonforge_runtime.core.redaction import redact_url

#: The OTLP resource's service name and the name of every span (one span per request).
SERVICE_NAME = "carbonforge-scheduler"
SPAN_NAME = "llm_request"

Record = Mapping[str, Any]


class SinkError(Exception):
    """A write failed; a later attempt may succeed."""


class PermanentSinkError(SinkError):
    """A write can never succeed (e.g. a missing library): drop without retrying."""


class Sink(Protocol):
    name: str

    def write(self, records: Sequence[Record]) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """Appends one JSON object per line. Reopens the file when it was removed or replaced, never
    writes through a symbolic link, and at the private (full) level keeps the file owner-only.

    Several engine cores (data parallel) may append to the same file, each with its own sink in its
    own process. Each batch is appended under an exclusive ``flock`` on the file, which every one of
    these writers takes: while it is held, the bytes from where the batch began to the end of the
    file are this batch's alone. So a failed or short append is cut back to where the batch began
    and never further: what the other writers appended stays, no partial line is left, and the
    retried batch lands whole, once. (Whole-line ``O_APPEND`` writes without a lock could not undo a
    short write without risking another writer's lines.) The cut is also skipped when the file grew
    by more than this batch wrote, in case a writer that takes no lock appended meanwhile."""

    def __init__(self, path: str, private: bool = False) -> None:
        self.path = path
        self.name = f"file {path}"
        self.private = private
        self.mode = 0o600 if private else 0o644
        self._fd: int | None = None
        self._ident: tuple[int, int] | None = None

    def _open(self) -> int:
        try:
            fd = files.open_append(self.path, self.mode)
        except files.SymlinkRefused as exc:  # no retry helps until the link is gone: drop and count
            raise PermanentSinkError(f"{exc}; fix: {exc.remedy}") from None
        except files.NotRegularFile as exc:
            raise SinkError(str(exc)) from None
        except OSError as exc:
            raise SinkError(f"cannot open {self.path}: {exc.strerror or exc}") from None
        info = os.fstat(fd)
        self._fd, self._ident = fd, (info.st_dev, info.st_ino)
        return fd

    def _current_fd(self) -> int:
        """The open descriptor, if it still names the file at ``path``; else a fresh one."""
        if self._fd is not None:
            try:
                info = os.stat(self.path, follow_symlinks=False)  # a link put in its place is never ours
                if (info.st_dev, info.st_ino) == self._ident:
                    return self._fd
            except OSError:
                pass
            self._close_fd()
        return self._open()

    def _close_fd(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = self._ident = None

    def _lock(self, fd: int) -> None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as exc:
            self._close_fd()
            raise PermanentSinkError(
                f"cannot lock {self.path} ({exc.strerror or exc}), so appends of several engine cores could "
                "not be kept apart; put the trace file on a filesystem with file locks (a local disk or volume)"
            ) from None

    def _keep_private(self, fd: int, mode: int) -> None:
        """At the full level the file holds prompts: make it owner-only (again, if it was replaced or
        widened) before anything is written, or write nothing."""
        if not self.private or stat.S_IMODE(mode) == 0o600:
            return
        try:
            os.fchmod(fd, 0o600)
        except OSError as exc:
            self._close_fd()
            raise PermanentSinkError(
                f"{self.path} has mode {stat.S_IMODE(mode):o} and cannot be made owner-only "
                f"({exc.strerror or exc}); records with prompts are not written to it; fix: remove the file "
                "or give the engine's user ownership of it"
            ) from None

    def write(self, records: Sequence[Record]) -> None:
        blob = "".join(json.dumps(r, ensure_ascii=False, separators=(", ", ": ")) + "\n" for r in records)
        data = blob.encode("utf-8")
        fd = self._current_fd()
        self._lock(fd)
        try:
            try:
                info = os.fstat(fd)
            except OSError as exc:
                self._close_fd()
                raise SinkError(f"cannot append to {self.path}: {exc.strerror or exc}") from None
            self._keep_private(fd, info.st_mode)
            start = done = info.st_size
            view = memoryview(data)
            try:
                while view:
                    written = os.write(fd, view)
                    done += written
                    view = view[written:]
            except OSError as exc:
                with contextlib.suppress(OSError):  # cut back our own partial tail: only whole lines remain
                    if done > start and os.fstat(fd).st_size == done:
                        os.ftruncate(fd, start)
                self._close_fd()
                raise SinkError(f"cannot append to {self.path}: {exc.strerror or exc}") from None
        finally:
            if self._fd == fd:  # closing the descriptor released the lock already
                with contextlib.suppress(OSError):
                    fcntl.flock(fd, fcntl.LOCK_UN)

    def close(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.fsync(self._fd)
        self._close_fd()


def span_attributes(record: Record) -> dict[str, Any]:
    """The OTLP attributes of one record (``None`` values are left out: OTLP has no null)."""
    attrs: dict[str, Any] = {
        "cf.request_id": record["request_id"],
        "gen_ai.usage.prompt_tokens": int(record["prompt_tokens"]),
        "gen_ai.usage.completion_tokens": int(record["output_tokens"]),
        "cf.e2e_latency_s": float(record["e2e_latency_s"]),
        "cf.queue_wait_s": float(record["queue_wait_s"]),
        "cf.scheduler.family": record["scheduler_family"],
    }
    optional = {
        "cf.ttft_s": ("ttft_s", float),
        "cf.priority_score": ("priority_score", float),
        "cf.finish_reason": ("finish_reason", str),
        "cf.cached_prompt_tokens": ("cached_prompt_tokens", int),
        "cf.preemptions": ("preemptions", int),
        "cf.engine_request_id": ("engine_request_id", str),
        "cf.energy_j": ("energy_j", float),
        "gen_ai.prompt": ("prompt_text", str),
        "gen_ai.completion": ("output_text", str),
    }
    for key, (name, kind) in optional.items():
        value = record.get(name)
        if value is not None:
            attrs[key] = kind(value)
    return attrs


def span_ids(record: Record) -> tuple[int, int]:
    """The trace id and span id of a record's span, derived from its request id and arrival time.

    OTLP delivery is at least once: an export whose answer times out is sent again, and the
    collector may already hold it. With ids that depend only on the record, the copy carries the
    same ids as the original, so a collector (or anyone counting spans) can tell it is a copy."""
    seed = f"{record.get('request_id')}|{record.get('t_arrival')!r}".encode()
    digest = hashlib.sha256(seed).digest()
    trace_id = int.from_bytes(digest[:16], "big") or 1
    span_id = int.from_bytes(digest[16:24], "big") or 1
    return trace_id, span_id


def _nanos(seconds: float) -> int:
    return round(seconds * 1e9)


class OtlpSink:
    """One span per record, exported with the OpenTelemetry SDK's OTLP exporter (gRPC or HTTP).

    Spans are made by a private tracer provider (never the global one, so vLLM's own tracing is
    untouched) and exported directly, so every failed export is seen and counted here.
    """

    def __init__(self, target: OtlpTarget, timeout_s: float) -> None:
        self.target = target
        self.timeout_s = timeout_s
        self.name = f"OTLP {target.protocol} {redact_url(target.endpoint)}"
        self._tracer: Any = None
        self._collected: list[Any] = []
        self._next_ids = [1, 1]
        self._exporter: Any = None
        self._provider: Any = None

    def _setup(self) -> None:
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
            from opentelemetry.sdk.trace.export import SpanExportResult

            if self.target.protocol == PROTOCOL_GRPC:
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc

                # TLS, CA and client files, and headers come from the SDK's own OTEL_EXPORTER_OTLP_*
                # variables: passing ``insecure`` (or anything else they set) here would override them.
                self._exporter = Grpc(endpoint=self.target.endpoint, timeout=self.timeout_s)
            else:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http

                self._exporter = Http(endpoint=self.target.endpoint, timeout=self.timeout_s)
        except ImportError as exc:
            raise PermanentSinkError(
                f"the OpenTelemetry SDK is not installed ({exc.name or exc}); install opentelemetry-sdk "
                "and opentelemetry-exporter-otlp"
            ) from None
        except Exception as exc:  # the SDK refused its OTEL_EXPORTER_OTLP_* settings: no retry helps
            raise PermanentSinkError(
                f"the OTLP exporter for {redact_url(self.target.endpoint)} cannot be set up "
                f"({type(exc).__name__}: {exc}); check the OTEL_EXPORTER_OTLP_* variables"
            ) from None
        from opentelemetry.sdk.trace.id_generator import IdGenerator

        collected = self._collected
        next_ids = self._next_ids

        class _RecordIds(IdGenerator):
            """Hands out the ids :func:`span_ids` chose for the span about to start."""

            def generate_trace_id(self) -> int:
                return next_ids[0]

            def generate_span_id(self) -> int:
                return next_ids[1]

        class _Collect(SpanProcessor):
            def on_end(self, span: Any) -> None:
                collected.append(span)

        self._ok = SpanExportResult.SUCCESS
        self._provider = TracerProvider(resource=Resource.create({"service.name": SERVICE_NAME}),
                                        id_generator=_RecordIds())
        self._provider.add_span_processor(_Collect())
        self._tracer = self._provider.get_tracer("carbonforge_runtime.engine")

    def _spans(self, records: Sequence[Record]) -> list[Any]:
        from opentelemetry.trace import SpanKind, Status, StatusCode

        self._collected.clear()
        for record in records:
            self._next_ids[:] = span_ids(record)
            span = self._tracer.start_span(
                SPAN_NAME,
                kind=SpanKind.INTERNAL,
                start_time=_nanos(record["t_arrival"]),
                attributes=span_attributes(record),
            )
            if record.get("finish_reason") == "error":
                span.set_status(Status(StatusCode.ERROR, "the engine ended the request with an error"))
            span.end(end_time=_nanos(record["t_completion"]))
        spans = list(self._collected)
        self._collected.clear()
        return spans

    def write(self, records: Sequence[Record]) -> None:
        if self._tracer is None:
            self._setup()
        try:
            result = self._exporter.export(self._spans(records))
        except Exception as exc:  # an exporter bug must not end the writer thread
            raise SinkError(f"export to {redact_url(self.target.endpoint)} failed: {exc}") from None
        if result != self._ok:
            why = "collector unreachable or refused"
            if self.target.endpoint.startswith("https://"):
                why += ", or its TLS certificate not trusted: check OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE"
            raise SinkError(f"export to {redact_url(self.target.endpoint)} failed ({why})")

    def close(self) -> None:
        if self._exporter is not None:
            with contextlib.suppress(Exception):
                self._exporter.shutdown()


def build_sinks(tracing: TraceConfig | None, feed: MetricsFeed | None = None, dp_rank: int = 0) -> list[Sink]:
    """Every sink the engine contract names: the trace's file (this data-parallel rank's own, with
    data parallel) and collector, and the runtime's metrics feed. The one place a new kind of sink
    is added."""
    sinks: list[Sink] = []
    file = tracing.file_of_rank(dp_rank) if tracing is not None else None
    if tracing is not None and file:
        sinks.append(JsonlSink(file, private=tracing.full))
    if tracing is not None and tracing.otlp:
        sinks.append(OtlpSink(tracing.otlp, timeout_s=tracing.export_timeout_s))
    if feed is not None:
        from carbonforge_runtime.engine.metrics_feed import FeedSink

        sinks.append(FeedSink(feed.socket, dp_rank=dp_rank))
    return sinks
