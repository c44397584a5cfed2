"""The engine's step log: one JSON line per engine step (and one per new request), for fitting a
step-time model (``carbonforge-runtime sim-calibrate``). Off unless the engine contract has a
``step_log`` part.

On the engine loop the scheduler calls three hooks: :meth:`StepLog.scheduled` (one dict write),
:meth:`StepLog.updated` (a dict pop, a few compares and one tuple append to the writer's intake) and,
for every new request, :meth:`StepLog.added` (a few compares and one append).
The tuple holds vLLM's own ``SchedulerOutput`` of the step: everything a line reports is read from
it on the writer's builder thread, never on the loop. That output is built fresh for every step
and holds each scheduled request's context as it was before the step (``num_computed_tokens`` of
its new and cached request data), which is what the step computed on; vLLM 0.32 does not change
those fields once ``schedule()`` returned.

Records leave through the request trace's machinery (:class:`~carbonforge_runtime.engine.trace_writer.TraceWriter`
with a :class:`~carbonforge_runtime.engine.trace_sinks.JsonlSink`): a bounded intake, a writer
thread, appends under a file lock, and every line given up on counted and reported in the engine log.

**Wall time.** A step's ``wall_s`` ends with ``update_from_output()`` for that step's output
(measured with the monotonic clock). It starts at the end of the previous step if the engine still
had unfinished requests then (it was busy and went straight on), and otherwise at the later of
``schedule()`` being entered and the end of the previous step (it waited for work). So while the
engine is busy, a step's wall time is the time between two consecutive step completions: with
synchronous scheduling (the CPU engine, or async scheduling off) scheduling, the forward pass, the
output processing and the engine core's handling of arriving requests and outgoing results before
the step; with asynchronous scheduling (vLLM's GPU default), where step k+1 is scheduled while
step k runs, the step's own forward pass plus whatever host work did not overlap it. The twin has
no other place for that host work, so it belongs in the steps it fits. Idle time is in no step.
Steps that schedule no token are not logged.

Line kinds (``kind``):

- ``engine``: written once when the scheduler starts: vLLM's version, the model, parallel sizes,
  the scheduler limits and the KV cache size in tokens (``kv_cache_tokens``: blocks x block size);
  on a paced engine (``serve --emulate``) also ``emulated_cost_model`` and ``emulated_slowdown``,
  because its step times are that model's, not the hardware's.
- ``step``: ``step`` (a number per engine), ``t`` (Unix time of the step's end), ``wall_s``,
  ``batched_tokens``, ``prefill_tokens`` (tokens of prompt chunks and recomputation),
  ``decode_tokens`` (requests decoding one token), ``seqs`` (requests in the step),
  ``kv_read_tokens`` (the context of every decoding request), ``attention_units`` (the sum of
  ``chunk * (context + chunk / 2)`` over the prompt chunks) and ``context_tokens`` (the context of
  every scheduled request). The split between decoding and prompt work is the twin's
  (:mod:`carbonforge_runtime.engine.twin`), so a fit of these terms is a fit of its model.
- ``request``: one per new request the scheduler receives (``add_request``): ``t_arrival`` (vLLM's
  arrival stamp, taken in the API server as rendering starts), ``t_added`` (Unix time when the
  scheduler received it), ``intake_window_s`` and ``prompt_tokens``. They measure the host's
  admission delay (:func:`carbonforge_runtime.core.twin_data.admission_delay_s`).

**Admission.** The engine core's input thread queues a request as soon as the API server hands it
over; the engine loop takes queued requests in only between two steps (and at once while it waits
for work). So ``t_added`` is where a request entered the scheduler, not where it reached the engine
core: that was at most ``intake_window_s`` earlier, after the loop last took requests in. The window
is 0 when the engine had been waiting for work (longer than :data:`INTAKE_WAKE_S`) and took the
request in at once; otherwise it runs from the last ``schedule()`` entered (the loop takes requests
in just before it schedules). The host's delay of a request is therefore between
``t_added - intake_window_s - t_arrival`` and ``t_added - t_arrival``; the wait for a step boundary
is the twin's own (it lets requests in only between steps), so the fit
(:func:`carbonforge_runtime.offline.sim.calibrate.fit_admission`) takes only the delay before it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from carbonforge_runtime.core.contract import Emulation, StepLogConfig, TraceConfig
from carbonforge_runtime.engine.trace_sinks import JsonlSink
from carbonforge_runtime.engine.trace_writer import TraceWriter

LABEL = "step log"
#: Steps scheduled and not yet ended that the log remembers (one or two in flight normally; more
#: only when outputs never reach ``update_from_output``, e.g. after an engine error).
MAX_OPEN_STEPS = 64
#: After the engine ran out of work, the time its loop may take to get back to waiting on its input
#: queue: a request taken in within it may have been queued during the last step; one taken in later
#: reached the engine core just then (the loop was waiting, and takes a request in as it comes).
INTAKE_WAKE_S = 0.02


def step_terms(output: Any) -> tuple[int, int, int, float, int]:
    """(prefill tokens, decoding requests, KV tokens read, attention units, context tokens) of one
    step, from its ``SchedulerOutput``: the twin's split of the step-time model's terms."""
    scheduled: Mapping[str, int] = output.num_scheduled_tokens
    prefill = decode = kv_read = context_all = 0
    attention = 0.0
    for new in output.scheduled_new_reqs:
        n = scheduled.get(new.req_id, 0)
        if not n:
            continue
        context = new.num_computed_tokens
        context_all += context
        if n == 1 and context >= new.prompt_len:
            decode += 1
            kv_read += context
        else:
            prefill += n
            attention += n * (context + n / 2)
    cached = output.scheduled_cached_reqs
    resumed = cached.resumed_req_ids
    for rid, context, outputs in zip(cached.req_ids, cached.num_computed_tokens, cached.num_output_tokens,
                                     strict=False):
        n = scheduled.get(rid, 0)
        if not n:
            continue
        context_all += context
        # Past its prompt (it has sampled), one token, and not recomputing after a preemption.
        if n == 1 and outputs > 0 and rid not in resumed:
            decode += 1
            kv_read += context
        else:
            prefill += n
            attention += n * (context + n / 2)
    return prefill, decode, kv_read, attention, context_all


def step_record(output: Any, start: float, end: float, number: int, engine: int,
                unix_offset: float) -> dict[str, Any]:
    """The line of one step, from its ``SchedulerOutput`` (on the writer thread)."""
    prefill, decode, kv_read, attention, context_all = step_terms(output)
    return {
        "kind": "step", "engine": engine, "step": number, "t": round(end + unix_offset, 6),
        "wall_s": round(end - start, 7), "batched_tokens": int(output.total_num_scheduled_tokens),
        "prefill_tokens": prefill, "decode_tokens": decode, "seqs": len(output.num_scheduled_tokens),
        "kv_read_tokens": kv_read, "attention_units": attention, "context_tokens": context_all,
    }


def request_record(arrival: float, prompt_tokens: int, added_unix: float, window: float,
                   engine: int) -> dict[str, Any]:
    """The line of one request the scheduler received (on the writer thread)."""
    return {"kind": "request", "engine": engine, "t_arrival": round(arrival, 6), "t_added": round(added_unix, 6),
            "intake_window_s": round(max(window, 0.0), 7), "prompt_tokens": prompt_tokens}


class _Added:
    """A request received, as the loop hands it to the writer."""

    __slots__ = ("added_unix", "arrival", "prompt_tokens", "window")

    def __init__(self, arrival: float, prompt_tokens: int, added_unix: float, window: float) -> None:
        self.arrival = arrival
        self.prompt_tokens = prompt_tokens
        self.added_unix = added_unix
        self.window = window


class StepLogWriter(TraceWriter):
    def shutdown_summary(self) -> str:
        per_sink = ", ".join(f"{w.sink.name}: {w.stats.written} written, {w.stats.dropped} dropped"
                             for w in self.workers) or "none"
        return (f"{self.submitted} lines submitted; {self.intake_dropped + self.build_failed} dropped before "
                f"the file; {per_sink}")


class StepLog:
    """The loop's side: :meth:`scheduled` and :meth:`updated`; everything else on the writer's threads."""

    def __init__(self, config: StepLogConfig, engine: int, log: logging.Logger,
                 clock: Any = time.monotonic, wall_clock: Any = time.time) -> None:
        self.config = config
        self.engine = engine
        self.clock = clock
        self._unix_offset = wall_clock() - clock()
        limits = TraceConfig(level="standard", file=config.file, queue_capacity=config.queue_capacity,
                             sink_capacity=config.sink_capacity, batch_max=config.batch_max,
                             report_interval_s=config.report_interval_s, flush_timeout_s=config.flush_timeout_s)
        self.writer = StepLogWriter([JsonlSink(config.file)], self._build, limits, log, clock, label=LABEL)
        self._starts: dict[int, float] = {}
        self._last_end = float("-inf")
        self._busy_at_last_end = False
        self.steps = 0
        #: Monotonic time since which a request being taken in may have waited in the engine core's
        #: input queue (see the module's description), and since when the engine has been out of
        #: work (None while it has work). It starts out of work.
        self._intake_from = clock()
        self._idle_since: float | None = self._intake_from

    def start(self, header: Mapping[str, Any]) -> StepLog:
        self.writer.start()
        self.writer.submit({"kind": "engine", "engine": self.engine,
                            "t": round(self.clock() + self._unix_offset, 6), **header})
        return self

    def _build(self, item: Any) -> dict[str, Any]:
        if isinstance(item, dict):
            return item
        if isinstance(item, _Added):
            return request_record(item.arrival, item.prompt_tokens, item.added_unix, item.window, self.engine)
        output, start, end, number = item
        return step_record(output, start, end, number, self.engine, self._unix_offset)

    # -- engine loop: O(1), never raises --

    def scheduled(self, output: object, entered: float) -> None:
        starts = self._starts
        if len(starts) >= MAX_OPEN_STEPS:
            starts.clear()
        starts[id(output)] = entered
        self._intake_from = entered  # the loop took requests in just before it scheduled
        self._idle_since = None

    def updated(self, output: Any, ended: float, busy: bool) -> None:
        """``busy``: the engine has unfinished requests after this step (it goes straight on)."""
        start = self._starts.pop(id(output), None)
        if start is None:
            return
        if start < self._last_end or self._busy_at_last_end:
            start = self._last_end
        self._last_end = ended
        self._busy_at_last_end = busy
        if not busy:
            self._idle_since = ended
        if output.total_num_scheduled_tokens:
            self.steps += 1
            self.writer.submit((output, start, ended, self.steps))

    def added(self, arrival: float, prompt_tokens: int, added_unix: float, now: float) -> None:
        """A new request entered the scheduler: ``arrival`` is its arrival stamp, ``added_unix`` and
        ``now`` the time it entered (Unix and monotonic)."""
        idle = self._idle_since
        if idle is not None:
            self._idle_since = None
            if now - idle > INTAKE_WAKE_S:  # the loop was waiting for work: it took this one in as it came
                self._intake_from = now
        self.writer.submit(_Added(arrival, prompt_tokens, added_unix, now - self._intake_from))

    # -- shutdown --

    def hurry(self) -> None:
        self.writer.hurry()

    def close(self) -> None:
        if not self.writer.closed:
            self.writer.close()


def engine_header(scheduler: Any) -> dict[str, Any]:
    """What the ``engine`` line says about the engine (each part best effort: never raises)."""
    header: dict[str, Any] = {}

    def put(name: str, read: Any) -> None:
        try:
            value = read()
        except Exception:
            return
        if isinstance(value, (str, int, float, bool)) or value is None:
            header[name] = value

    config: Any = getattr(scheduler, "vllm_config", None)
    put("model", lambda: str(config.model_config.served_model_name or config.model_config.model))
    put("tensor_parallel_size", lambda: int(config.parallel_config.tensor_parallel_size))
    put("pipeline_parallel_size", lambda: int(config.parallel_config.pipeline_parallel_size))
    put("data_parallel_rank", lambda: int(config.parallel_config.data_parallel_rank))
    put("async_scheduling", lambda: bool(config.scheduler_config.async_scheduling))
    put("max_num_seqs", lambda: int(config.scheduler_config.max_num_seqs))
    put("max_num_batched_tokens", lambda: int(config.scheduler_config.max_num_batched_tokens))
    put("enable_chunked_prefill", lambda: bool(config.scheduler_config.enable_chunked_prefill))
    put("enable_prefix_caching", lambda: bool(config.cache_config.enable_prefix_caching))
    put("block_size", lambda: int(scheduler.block_size))
    put("kv_cache_groups", lambda: len(scheduler.kv_cache_config.kv_cache_groups))
    put("kv_cache_tokens", lambda: int(scheduler.kv_cache_config.num_blocks) * int(scheduler.block_size))
    return header


def start_step_log(config: StepLogConfig, scheduler: Any, log: logging.Logger, vllm_version: str,
                   emulation: Emulation | None = None) -> StepLog:
    header = {"vllm": vllm_version, **engine_header(scheduler)}
    if emulation is not None:
        header |= {"emulated_cost_model": emulation.model, "emulated_slowdown": emulation.slowdown}
    engine = header.get("data_parallel_rank", 0)
    step_log = StepLog(config, engine if isinstance(engine, int) else 0, log).start(header)
    log.info("step log: one line per engine step to %s (for sim-calibrate)", config.file)
    return step_log
