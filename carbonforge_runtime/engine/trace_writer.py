"""Moves records off the engine loop: a bounded intake queue, a builder thread, one worker thread
per sink with its own bounded buffer, retries with backoff, and counted drops.

The engine loop only calls :meth:`TraceWriter.submit` (an append to a deque, or a counter
increment when the queue is full); it never waits on disk or network. A failing sink holds its
records and retries while the other sinks carry on. Every record that is given up on is counted
and reported in a periodic warning, and once more at :meth:`TraceWriter.close`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from carbonforge_runtime.core.contract import TraceConfig
from carbonforge_runtime.core.feed_protocol import EngineCounters
from carbonforge_runtime.engine.trace_sinks import PermanentSinkError, Record, Sink

POLL_INTERVAL_S = 0.1
#: At shutdown, how long a sink that is currently failing may keep retrying.
FAILING_SINK_GRACE_S = 0.5


@dataclass
class SinkStats:
    written: int = 0
    dropped: int = 0
    reported_dropped: int = 0
    failing: bool = False
    last_error: str | None = None
    reasons: dict[str, int] = field(default_factory=dict)


class SinkWorker:
    """One sink on its own thread, with its own buffer, backoff and drop count.

    Every record offered ends up counted exactly once: written, or dropped with a reason. Past
    the shutdown deadline the worker is abandoned: what it still holds is counted as dropped at
    once, and anything its thread does later is not counted again.
    """

    def __init__(self, sink: Sink, config: TraceConfig, log: logging.Logger,
                 clock: Callable[[], float] = time.monotonic, label: str = "request trace") -> None:
        self.sink = sink
        self.label = label
        self.config = config
        self.log = log
        self.clock = clock
        self.stats = SinkStats()
        self._buffer: deque[Record] = deque()
        self._wake = threading.Event()
        self._stop = threading.Event()  # ends a backoff wait early once the worker is abandoned
        self._closing = False
        self._abandoned = False
        self._deadline: float | None = None
        self._inflight = 0  # records of the batch being written
        self._maintain_error = ""  # the last upkeep failure logged, so it is logged once
        self._lock = threading.Lock()  # guards the buffer, the in-flight count and the stats
        self._thread = threading.Thread(target=self._run, name=f"cf-trace-{sink.name}", daemon=True)

    @property
    def pending(self) -> int:
        return len(self._buffer) + self._inflight

    def start(self) -> None:
        self._thread.start()

    def offer(self, records: Sequence[Record]) -> None:
        with self._lock:
            if self._abandoned:
                self._count_drop(len(records), "the shutdown flush ran out of time")
                return
            room = max(self.config.sink_capacity - len(self._buffer), 0)
            if room < len(records):
                self._count_drop(len(records) - room, "its buffer was full while it retried")
                records = records[:room]
            self._buffer.extend(records)
        self._wake.set()

    def _count_drop(self, count: int, reason: str) -> None:
        """Callers hold the lock."""
        if count > 0:
            self.stats.dropped += count
            self.stats.reasons[reason] = self.stats.reasons.get(reason, 0) + count

    def _settle(self, count: int, written: bool, reason: str = "") -> bool:
        """Count the batch just finished (unless the worker was abandoned); True if it was."""
        with self._lock:
            self._inflight = 0
            if self._abandoned:
                return True
            if written:
                self.stats.written += count
            else:
                self._count_drop(count, reason)
            return False

    def _take_batch(self) -> list[Record] | None:
        """The next batch, or None when the worker should stop."""
        with self._lock:
            if self._abandoned:
                return None
            batch: list[Record] = []
            while self._buffer and len(batch) < self.config.batch_max:
                batch.append(self._buffer.popleft())
            self._inflight = len(batch)
            return batch

    def _past_deadline(self) -> bool:
        return self._deadline is not None and self.clock() >= self._deadline

    def _run(self) -> None:
        backoff = self.config.backoff_initial_s
        while True:
            if not self._buffer:
                if self._closing or self._abandoned:
                    return
                self._maintain()
                self._wake.wait(POLL_INTERVAL_S)
                self._wake.clear()
                continue
            batch = self._take_batch()
            if batch is None:
                return
            attempts = 0
            while True:
                try:
                    self.sink.write(batch)
                except PermanentSinkError as exc:
                    self._failed(str(exc))
                    self._settle(len(batch), False, str(exc))
                    break
                except Exception as exc:
                    attempts += 1
                    self._failed(str(exc) or type(exc).__name__)
                    if attempts >= self.config.retry_attempts or self._past_deadline() or self._abandoned:
                        self._settle(len(batch), False, f"{attempts} attempts failed: {self.stats.last_error}")
                        break
                    wait_s = backoff
                    if self._deadline is not None:
                        wait_s = min(wait_s, max(self._deadline - self.clock(), 0.0))
                    self._stop.wait(wait_s)
                    backoff = min(backoff * 2, self.config.backoff_max_s)
                    continue
                with self._lock:
                    recovered = self.stats.failing and not self._abandoned
                    self.stats.failing = False
                if self._settle(len(batch), True):
                    return
                if recovered:
                    self.log.warning("%s: sink %s works again", self.label, self.sink.name)
                backoff = self.config.backoff_initial_s
                break

    def _maintain(self) -> None:
        """Let a sink that keeps its output tidy (the trace file's retention) do so while idle; a failure
        there is logged once per message and never stops the worker."""
        maintain = getattr(self.sink, "maintain", None)
        if maintain is None:
            return
        try:
            maintain()
        except Exception as exc:
            message = str(exc) or type(exc).__name__
            if message != self._maintain_error:
                self._maintain_error = message
                self.log.warning("%s: upkeep of sink %s failed: %s", self.label, self.sink.name, message)

    def _failed(self, error: str) -> None:
        with self._lock:
            first = not self.stats.failing
            self.stats.failing = True
            self.stats.last_error = error
        if first:
            self.log.warning(
                "%s: sink %s failed: %s; serving continues, the sink retries with backoff and "
                "every record it gives up on is counted", self.label, self.sink.name, error,
            )

    def begin_close(self, deadline: float) -> None:
        """Write what is buffered until ``deadline`` (a ``clock()`` value), then stop. A sink that
        is failing gets only a short grace: a dead collector must not hold up the engine's exit."""
        if self.stats.failing:
            deadline = min(deadline, self.clock() + FAILING_SINK_GRACE_S)
        self._deadline = deadline
        self._closing = True
        self._wake.set()

    def close(self, deadline: float) -> None:
        if self._deadline is None:
            self.begin_close(deadline)
        assert self._deadline is not None
        self._thread.join(max(self._deadline - self.clock(), 0.0) + 0.25)
        with self._lock:
            self._abandoned = True
            if self._inflight:
                self._count_drop(self._inflight, "a write was still under way when the shutdown flush ran out "
                                                 "of time")
                self._inflight = 0
            if self._buffer:
                self._count_drop(len(self._buffer), "the shutdown flush ran out of time")
                self._buffer.clear()
        self._stop.set()
        try:
            self.sink.close()
        except Exception as exc:
            self.log.warning("%s: closing sink %s failed: %s", self.label, self.sink.name, exc)


class TraceWriter:
    """The engine's side of tracing: ``submit`` on the loop, everything else on threads."""

    def __init__(
        self,
        sinks: Sequence[Sink],
        build: Callable[[Any], Record],
        config: TraceConfig,
        log: logging.Logger,
        clock: Callable[[], float] = time.monotonic,
        label: str = "request trace",
    ) -> None:
        #: What the log lines call this writer's output.
        self.label = label
        self.config = config
        self.build = build
        self.log = log
        self.clock = clock
        self.counters = EngineCounters()
        self.workers = [SinkWorker(sink, config, log, clock, label) for sink in sinks]
        self._intake: deque[Any] = deque()
        self.intake_dropped = 0
        self._intake_reported = 0
        self.build_failed = 0
        self.submitted = 0
        self._closing = False
        self._closed = False
        self.eager = False
        self._building = 0  # taken from the intake, not yet offered to the sinks
        self._wake = threading.Event()
        self._next_report = clock() + config.report_interval_s
        self._thread = threading.Thread(target=self._run, name="cf-trace-builder", daemon=True)

    def start(self) -> TraceWriter:
        for worker in self.workers:
            worker.start()
        self._thread.start()
        return self

    def submit(self, item: Any) -> None:
        """Called on the engine loop: O(1), never blocks, never raises."""
        if len(self._intake) >= self.config.queue_capacity or self._closed:
            self.intake_dropped += 1
            return
        self.submitted += 1
        self._intake.append(item)
        if self.eager:
            self._wake.set()

    def pending(self) -> int:
        """Records submitted and not yet handed to the sinks."""
        return len(self._intake) + self._building

    def hurry(self) -> None:
        """From now on write each record as soon as it arrives (the engine is shutting down and
        may be stopped at any moment), instead of in batches every 0.1 s."""
        self.eager = True
        self._wake.set()

    def _drain(self) -> None:
        records: list[Record] = []
        while self._intake:
            item = self._intake.popleft()
            self._building += 1
            try:
                records.append(self.build(item))
            except Exception as exc:  # a bad record must not stop the others
                self.build_failed += 1
                self._building -= 1
                self.log.warning("%s: could not build a record: %s", self.label, exc)
            if len(records) >= self.config.batch_max:
                self._offer(records)
                records = []
        if records:
            self._offer(records)

    def _offer(self, records: list[Record]) -> None:
        for worker in self.workers:
            worker.offer(records)
        self._building -= len(records)

    def _run(self) -> None:
        while True:
            self._wake.wait(POLL_INTERVAL_S)
            self._wake.clear()
            self._drain()
            if self.clock() >= self._next_report:
                self._next_report = self.clock() + self.config.report_interval_s
                self.report()
            if self._closing and not self._intake:
                self._drain()
                return

    def dropped(self) -> dict[str, int]:
        """Dropped records so far, per sink (and ``queue`` for the engine-side intake)."""
        out = {worker.sink.name: worker.stats.dropped for worker in self.workers}
        out["queue"] = self.intake_dropped + self.build_failed
        return out

    def report(self, final: bool = False) -> None:
        """Warn about records dropped since the last report."""
        lines = []
        new_intake = self.intake_dropped - self._intake_reported
        if new_intake:
            self._intake_reported = self.intake_dropped
            lines.append(f"{new_intake} dropped before reaching any sink (queue of "
                         f"{self.config.queue_capacity} full; {self.intake_dropped} in total)")
        for worker in self.workers:
            stats = worker.stats
            new = stats.dropped - stats.reported_dropped
            if new:
                stats.reported_dropped = stats.dropped
                reasons = "; ".join(f"{count}: {reason}" for reason, count in stats.reasons.items())
                lines.append(f"{new} dropped by sink {worker.sink.name} "
                             f"({stats.dropped} in total; {reasons})")
        if lines:
            when = "at shutdown" if final else f"in the last {self.config.report_interval_s:g} s"
            self.log.warning("%s: records dropped %s: %s", self.label, when, " | ".join(lines))

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, timeout_s: float | None = None) -> dict[str, int]:
        """Write every queued record (until ``timeout_s``), stop the threads, report drops.
        Safe to call more than once."""
        if self._closed:
            return self.dropped()
        timeout_s = self.config.flush_timeout_s if timeout_s is None else timeout_s
        deadline = self.clock() + timeout_s
        self._closing = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(max(deadline - self.clock(), 0.0))
        self._closed = True
        leftover = len(self._intake)
        if leftover:
            self.intake_dropped += leftover
            self._intake.clear()
        for worker in self.workers:
            worker.begin_close(deadline)
        for worker in self.workers:
            worker.close(deadline)
        self.report(final=True)
        self.log.info("%s: flushed at shutdown; %s", self.label, self.shutdown_summary())
        return self.dropped()

    def shutdown_summary(self) -> str:
        """How many requests reached the engine, and what became of their records per sink: each
        request ends as a record written or a drop counted (before the sinks, or in one)."""
        before_sinks = self.intake_dropped + self.build_failed
        per_sink = ", ".join(
            f"{worker.sink.name}: {worker.stats.written} written, {worker.stats.dropped} dropped"
            for worker in self.workers
        ) or "none"
        return (f"{self.counters.requests_arrived_total} requests reached the engine, "
                f"{self.counters.requests_completed_total} ended; {before_sinks} dropped before the sinks; "
                f"records per sink: {per_sink}")
