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
import logging
import os
import stat
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from carbonforge_runtime import files
from carbonforge_runtime.core.contract import PROTOCOL_GRPC, MetricsFeed, OtlpTarget, TraceConfig
from carbonforge_runtime.core.redaction import redact_url
from carbonforge_runtime.core.trace_retention import (
    SegmentNames,
    boundary_after,
    format_duration,
    period_word,
    rotation_period,
    segment_path,
)

#: The OTLP resource's service name and the name of every span (one span per request).
SERVICE_NAME = "carbonforge-scheduler"
SPAN_NAME = "llm_request"

Record = Mapping[str, Any]

#: The scheduler's logger (a child of vLLM's, so lines land in vllm.log).
log = logging.getLogger("vllm.carbonforge")
#: With a retention, how often (in seconds of the sink's clock) expired segments are looked for.
SWEEP_INTERVAL_S = 60.0


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

    def __init__(self, path: str, private: bool = False, *, retention_s: float | None = None,
                 family: str | None = None, clock: Callable[[], float] = time.time) -> None:
        self.path = path
        self.name = f"file {path}"
        self.private = private
        self.mode = 0o600 if private else 0o644
        self._fd: int | None = None
        self._ident: tuple[int, int] | None = None
        #: With a retention (CF_TRACE_RETENTION), see :class:`Rotation`.
        self.rotation = Rotation(path, retention_s, family or path, clock) if retention_s else None

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
        if self.rotation is not None:
            self.rotation.opened(info)
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
        now = self.rotation.clock() if self.rotation is not None else 0.0
        fd = self._current_fd()
        self._lock(fd)
        if self.rotation is not None and self.rotation.due(now):
            fd = self._rotate(fd, now, reopen=True)
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
        if self.rotation is not None:
            self.rotation.written(now)
            self.rotation.sweep_if_due(now)

    def _rotate(self, fd: int, now: float, reopen: bool) -> int:
        """With ``fd`` locked: rename the file to its segment, then (``reopen``) open and lock a new one
        at ``path`` and return it. When the rename fails, the records go on into the same file (a later
        rotation tries again): rotating never costs a record."""
        assert self.rotation is not None
        try:
            info = os.stat(self.path, follow_symlinks=False)
            ours = (info.st_dev, info.st_ino) == self._ident
        except OSError:
            ours = False
        if not ours:  # replaced or removed meanwhile: nothing of ours to rename
            self._close_fd()
            return self._locked_fd() if reopen else -1
        if not self.rotation.rename(self.path, now):
            if not reopen:
                with contextlib.suppress(OSError):
                    fcntl.flock(fd, fcntl.LOCK_UN)
            return fd
        self._close_fd()  # releases the lock: the segment is complete, and nothing appends to it again
        return self._locked_fd() if reopen else -1

    def _locked_fd(self) -> int:
        fd = self._open()
        self._lock(fd)
        return fd

    def maintain(self) -> None:
        """Called by the sink's worker while it has nothing to write: with a retention, close the file
        once its period is over even without traffic, and delete expired segments."""
        rotation = self.rotation
        if rotation is None:
            return
        now = rotation.clock()
        if self._fd is None and rotation.unknown_file:
            rotation.unknown_file = False
            try:  # a file left by an earlier run: open it (never creating it) to learn its period
                info = os.stat(self.path, follow_symlinks=False)
                if stat.S_ISREG(info.st_mode) and info.st_size > 0:
                    self._open()
            except (OSError, SinkError):
                pass
        if self._fd is not None and rotation.due(now):
            fd = self._fd
            self._lock(fd)
            self._rotate(fd, now, reopen=False)
        rotation.sweep_if_due(now)

    def close(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.fsync(self._fd)
        self._close_fd()


class Rotation:
    """The retention of one trace file (CF_TRACE_RETENTION), on the sink's own thread.

    The file is closed at the end of each rotation period (UTC boundaries, see
    :mod:`~carbonforge_runtime.core.trace_retention`) and renamed to a sibling segment stamped with
    that boundary, between two batches and under the file's lock, so a record is never split and
    every segment holds whole lines. Segments whose stamp is more than the retention ago hold only
    records older than the retention and are deleted, each with one log line. The file being written
    has no stamp and is never deleted; only names of exactly the segment pattern of this trace file
    (and of its data-parallel rank files) are touched. ``clock`` gives wall-clock Unix seconds.
    """

    def __init__(self, path: str, retention_s: float, family: str, clock: Callable[[], float]) -> None:
        self.path = path
        self.retention_s = retention_s
        self.period_s = rotation_period(retention_s)
        self.clock = clock
        self.names = SegmentNames(family)
        self.directory = os.path.dirname(path) or "."
        #: The end of the period of the newest record in the open file (None: the file is empty).
        self.boundary: float | None = None
        #: True until the file left at ``path`` by an earlier run has been looked at.
        self.unknown_file = True
        self._next_sweep = float("-inf")
        self._warned: set[str] = set()

    @property
    def policy(self) -> str:
        return (f"CF_TRACE_RETENTION={format_duration(self.retention_s)}, rotated "
                f"{period_word(self.period_s)}")

    def opened(self, info: os.stat_result) -> None:
        """A descriptor on the file was opened: a file with records is dated by its last write."""
        self.unknown_file = False
        self.boundary = boundary_after(info.st_mtime, self.period_s) if info.st_size > 0 else None

    def due(self, now: float) -> bool:
        return self.boundary is not None and now >= self.boundary

    def written(self, now: float) -> None:
        end = boundary_after(now, self.period_s)
        self.boundary = end if self.boundary is None else max(self.boundary, end)

    def rename(self, path: str, now: float) -> bool:
        """Rename the file to the segment of its period (never over an existing file); False on failure."""
        assert self.boundary is not None
        boundary = self.boundary
        try:
            copy = 1
            while os.path.lexists(target := segment_path(path, boundary, copy)):
                copy += 1
            os.rename(path, target)
        except OSError as exc:
            self._warn_once(f"rotate:{boundary}", "request trace: cannot rotate %s (%s); records go on into it "
                            "and it is rotated at a later boundary; fix: let the engine's user create and rename "
                            "files in %s", path, exc.strerror or exc, self.directory)
            return False
        self.boundary = None
        log.info("request trace: closed %s as %s (%s)", os.path.basename(path), os.path.basename(target),
                 self.policy)
        self._next_sweep = float("-inf")  # a boundary passed: look for segments that expired with it
        return True

    def sweep_if_due(self, now: float) -> None:
        if now < self._next_sweep:
            return
        self._next_sweep = now + SWEEP_INTERVAL_S
        try:
            entries = list(os.scandir(self.directory))
        except OSError as exc:
            self._warn_once("scan", "request trace: cannot list %s to delete expired trace segments (%s); fix: "
                            "let the engine's user read that directory", self.directory, exc.strerror or exc)
            return
        for entry in sorted(entries, key=lambda e: e.name):
            segment = self.names.match(entry.name)
            if segment is None:
                continue
            age = now - segment.closed_at
            if age <= self.retention_s:
                continue
            try:
                if not entry.is_file(follow_symlinks=False):  # never ours: we write regular files only
                    continue
                os.unlink(entry.path)
            except FileNotFoundError:  # another rank's sink deleted it first
                continue
            except OSError as exc:
                self._warn_once(f"delete:{entry.name}", "request trace: cannot delete expired trace segment %s "
                                "(%s); fix: let the engine's user delete files in %s", entry.path,
                                exc.strerror or exc, self.directory)
                continue
            log.info("request trace: deleted expired trace segment %s (age %s: its newest record is older than "
                     "%s; %s)", entry.path, format_duration(age), format_duration(self.retention_s), self.policy)

    def _warn_once(self, key: str, message: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message, *args)


#: Each of a record's tags is the span attribute ``cf.tag.<name>``.
TAG_ATTRIBUTE_PREFIX = "cf.tag."


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
        "gen_ai.request.model": ("model", str),
        "cf.tenant": ("tenant", str),
        "gen_ai.prompt": ("prompt_text", str),
        "gen_ai.completion": ("output_text", str),
    }
    for key, (name, kind) in optional.items():
        value = record.get(name)
        if value is not None:
            attrs[key] = kind(value)
    for tag, value in (record.get("tags") or {}).items():
        attrs[TAG_ATTRIBUTE_PREFIX + str(tag)] = str(value)
    return attrs


def span_ids(record: Record) -> tuple[int, int]:
    """The trace id and span id of a record's span: the trace from its request id and arrival time, the
    span from the engine's id for it too, so that the records of one request (each sample of
    ``n > 1``, each prompt of ``/v1/completions``) are spans of their own.

    OTLP delivery is at least once: an export whose answer times out is sent again, and the
    collector may already hold it. With ids that depend only on the record, the copy carries the
    same ids as the original, so a collector (or anyone counting spans) can tell it is a copy."""
    arrival = repr(record.get("t_arrival"))
    digest = hashlib.sha256(f"{record.get('request_id')}|{arrival}".encode()).digest()
    engine_id = record.get("engine_request_id") or record.get("request_id")
    span_digest = hashlib.sha256(f"{engine_id}|{arrival}".encode()).digest()
    trace_id = int.from_bytes(digest[:16], "big") or 1
    span_id = int.from_bytes(span_digest[16:24], "big") or 1
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
        sinks.append(JsonlSink(file, private=tracing.full, retention_s=tracing.retention_s, family=tracing.file))
    if tracing is not None and tracing.otlp:
        sinks.append(OtlpSink(tracing.otlp, timeout_s=tracing.export_timeout_s))
    if feed is not None:
        from carbonforge_runtime.engine.metrics_feed import FeedSink

        sinks.append(FeedSink(feed.socket, dp_rank=dp_rank))
    return sinks
