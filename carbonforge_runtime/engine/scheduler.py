"""The scheduler vLLM runs inside its engine-core process (``--scheduler-cls``).

It subclasses the stock V1 scheduler of the pinned vLLM and overrides only public hooks:
``add_request`` (arrival), ``schedule`` (first admission), ``update_from_output`` (first token,
normal completion), ``finish_requests`` (aborts and errors), ``has_requests`` and ``shutdown``
(write every queued record before the engine exits, see :meth:`_CarbonForgeMixin.has_requests`).
One private method is overridden as well, ``_reserve_prefill_lookahead``: vLLM 0.32 passes every
chunk it schedules through it last, and the tenants' prompt budgets of a step are applied there
(:meth:`_CarbonForgeMixin._reserve_prefill_lookahead`; a unit test fails if vLLM stops calling it).
Per step it does a handful of attribute writes plus work proportional to the requests admitted
or finished in that step (with the step log on, two clock reads, a dict write and pop and one
append, and per new request two clock reads and one append:
:mod:`~carbonforge_runtime.engine.step_log`); records leave through
:class:`~carbonforge_runtime.engine.trace_writer.TraceWriter`, which never blocks the loop. A
family that reorders replaces ``self.waiting`` with :class:`ScoredQueue`.

Like every module of the engine package (the only package that imports vLLM), it is written
against vLLM 0.32's scheduler interface.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from vllm import __version__ as VLLM_VERSION
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.request_queue import RequestQueue
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
from vllm.v1.request import Request, RequestStatus

from carbonforge_runtime.core.contract import (
    CORE_DONE_MARKER,
    ContractError,
    EngineContract,
    TraceConfig,
    full_level_banner_lines,
)
from carbonforge_runtime.core.feed_protocol import EngineCounters
from carbonforge_runtime.core.ordering.base import Family, WaitingRequest
from carbonforge_runtime.core.ordering.prefill_budget import grant, is_prefill, prefill_budgets, spent
from carbonforge_runtime.core.ordering.registry import make_family
from carbonforge_runtime.core.ordering.tenancy import Ledger, pick_fair, read_fairness, tenancy_of
from carbonforge_runtime.core.request_tags import MODEL_ARG, TAGS_ARG, TENANT_ARG
from carbonforge_runtime.core.trace_record import LEVEL_STANDARD, Completion, Decoder, build_record, client_request_id
from carbonforge_runtime.engine.energy_meter import EnergyMeter, start_meter
from carbonforge_runtime.engine.metrics_feed import attach as attach_feed
from carbonforge_runtime.engine.pacing import Pacer, start_pacer
from carbonforge_runtime.engine.step_log import StepLog, start_step_log
from carbonforge_runtime.engine.trace_sinks import build_sinks
from carbonforge_runtime.engine.trace_writer import TraceWriter

#: A child of vLLM's logger, so lines land in vllm.log with vLLM's format.
log = logging.getLogger("vllm.carbonforge")

_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_IGNORED: "length",
    RequestStatus.FINISHED_ERROR: "error",
    RequestStatus.FINISHED_REPETITION: "repetition",
}
PREFIX_HASH_TOKENS = 64
#: Before vLLM's drain deadline, time kept for the last step, the record flush and the exit.
DEADLINE_MARGIN_S = 2.0
#: Benchmarks only: the true output length a replayer sends (``vllm_xargs``) for the oracle family.
TRUE_OUTPUT_TOKENS_ARG = "cf_true_output_tokens"


class _Live:
    """What the shim remembers about one request between arrival and completion."""

    __slots__ = ("cached_prompt_tokens", "charged_output", "done", "peek_score", "priority_score", "request",
                 "t_first_token", "t_scheduled", "waiting")

    def __init__(self, request: Request) -> None:
        self.request = request
        self.t_scheduled: float | None = None
        self.t_first_token: float | None = None
        self.cached_prompt_tokens: int | None = None
        self.peek_score: float | None = None
        self.priority_score: float | None = None
        self.waiting: WaitingRequest | None = None
        self.done = False
        #: Output tokens counted to the tenant's fair-share counter; -1 until the queue handed it to admission.
        self.charged_output = -1


def abort_delay(shutdown_timeout_s: float, flush_timeout_s: float) -> float:
    """Seconds after the shutdown signal at which the shim ends the requests still running.

    vLLM's process manager SIGKILLs the engine core ``shutdown_timeout_s`` after it signalled it,
    and a SIGKILLed engine writes no record. Ending the leftovers as aborts a little earlier (time
    for the record flush plus a margin, never more than half the drain) gives each of them its
    record and each client its answer, and lets the engine exit on its own."""
    if shutdown_timeout_s <= 0:
        return 0.0  # vLLM aborts everything itself at once
    margin = min(flush_timeout_s + DEADLINE_MARGIN_S, shutdown_timeout_s / 2)
    return shutdown_timeout_s - margin


def prefix_hash(token_ids: Sequence[int] | None) -> int:
    """Stable across processes (a tuple of ints hashes the same everywhere)."""
    return hash(tuple(token_ids[:PREFIX_HASH_TOKENS])) if token_ids else 0


def waiting_request(request: Request) -> WaitingRequest:
    """What a family sees of ``request`` (``cached_tokens`` is filled at peek time)."""
    params = request.sampling_params
    true_output = None
    extra = params.extra_args if params is not None else None
    if extra:
        value = extra.get(TRUE_OUTPUT_TOKENS_ARG)
        if isinstance(value, int) and not isinstance(value, bool):
            true_output = value
    tenant, priority, share = tenancy_of(extra)
    return WaitingRequest(
        request_id=client_request_id(request.request_id),
        arrival_time=request.arrival_time,
        prompt_tokens=request.num_prompt_tokens,
        cached_tokens=0,
        max_tokens=params.max_tokens if params is not None else None,
        prefix_hash=prefix_hash(request.prompt_token_ids),
        num_preemptions=request.num_preemptions,
        true_output_tokens=true_output,
        tenant=tenant,
        priority=priority,
        share=share,
    )


class ScoredQueue(RequestQueue):
    """vLLM's waiting queue, ordered by priority class, tenant and a family's score.

    Requests put back at the front (preempted ones, and those the scan skipped this step) are
    served first, in order, as in vLLM's own queue. The rest are scored at every
    ``peek_request`` (scores that read the prefix cache are only valid before the peeked
    request allocates), and ``pop_request`` takes the request the last peek chose. With a
    ``ledger`` the choice is :func:`~carbonforge_runtime.core.ordering.tenancy.pick_fair`'s (the
    highest class, then the least-served tenant, then the family); a request taken from the pool
    is charged its prompt to its tenant.
    """

    def __init__(
        self,
        family: Family,
        live: dict[str, _Live],
        cached_tokens_of: Callable[[Request], int],
        clock: Callable[[], float] = time.time,
        ledger: Ledger | None = None,
    ) -> None:
        self.family = family
        self.live = live
        self.cached_tokens_of = cached_tokens_of
        #: pick_next's bound on overtaking; a family carries it (from its guard parameters).
        self.max_overtake_s: float | None = getattr(family, "max_overtake_s", None)
        self.ledger = ledger
        #: Brings the tenants' counters up to date with the output tokens generated (set by the scheduler).
        self.sync_service: Callable[[], None] | None = None
        #: Whether tokens were generated since the last sync (set at each step's output).
        self.service_stale = False
        #: The step's prompt budgets of capped tenants (the scheduler's dict, core/ordering/prefill_budget.py).
        self.prefill_left: dict[str, int] = {}
        #: Past this many waiting requests the prefix cache is not asked (cached_tokens stays 0).
        self.cache_lookup_limit: int | None = getattr(family, "cache_lookup_limit", None)
        self.clock = clock
        self._front: deque[Request] = deque()
        self._pool: list[Request] = []
        self._peeked: Request | None = None
        self._peeked_index = -1

    def _waiting(self, request: Request, look_up_cache: bool) -> WaitingRequest:
        state = self.live.get(request.request_id)
        wr = state.waiting if state is not None else None
        if wr is None:
            wr = waiting_request(request)
            if state is not None:
                state.waiting = wr
        wr.num_preemptions = request.num_preemptions
        wr.cached_tokens = self.cached_tokens_of(request) if look_up_cache else 0
        return wr

    def _known(self, request: Request) -> WaitingRequest:
        state = self.live.get(request.request_id)
        if state is None:
            return waiting_request(request)
        if state.waiting is None:
            state.waiting = waiting_request(request)
        return state.waiting

    def add_request(self, request: Request) -> None:
        self._pool.append(request)
        if self.ledger is not None:
            self.ledger.arrive(self._known(request))

    def peek_request(self) -> Request:
        if self._front:
            return self._front[0]
        if not self._pool:
            raise IndexError("peek from an empty queue")
        now = self.clock()
        look_up = self.family.needs_cache_lookup and (
            self.cache_lookup_limit is None or len(self._pool) <= self.cache_lookup_limit
        )
        waiting = [self._waiting(r, look_up) for r in self._pool]
        ledger = self.ledger
        if ledger is not None and self.service_stale and ledger.mixed and self.sync_service is not None:
            self.service_stale = False
            self.sync_service()
        skip = spent(self.prefill_left) if self.prefill_left else ()
        index, score = pick_fair(waiting, self.family.score, now, self.max_overtake_s, ledger, skip)
        chosen = self._pool[index]
        self._peeked, self._peeked_index = chosen, index
        state = self.live.get(chosen.request_id)
        if state is not None:
            state.peek_score = score if self.family.reorders else None
        return chosen

    def pop_request(self) -> Request:
        if self._front:
            return self._front.popleft()
        if not self._pool:
            raise IndexError("pop from an empty queue")
        index = self._peeked_index
        if not (0 <= index < len(self._pool) and self._pool[index] is self._peeked):
            self.peek_request()
            index = self._peeked_index
        self._peeked, self._peeked_index = None, -1
        request = self._pool.pop(index)
        ledger = self.ledger
        if ledger is not None:
            wr = self._known(request)
            ledger.leave(wr)
            state = self.live.get(request.request_id)
            if state is None or state.charged_output < 0:
                ledger.charge(wr.tenant, wr.share, prompt_tokens=wr.prompt_tokens)
                if state is not None:
                    state.charged_output = 0
        return request

    def prepend_request(self, request: Request) -> None:
        self._front.appendleft(request)

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        self._front.extendleft(requests)

    def remove_request(self, request: Request) -> None:
        self.remove_requests((request,))

    def remove_requests(self, requests: Iterable[Request]) -> None:
        gone = {id(r) for r in requests}
        if not gone:
            return
        self._front = deque(r for r in self._front if id(r) not in gone)
        if self.ledger is not None:
            for r in self._pool:
                if id(r) in gone:
                    self.ledger.leave(self._known(r))
        self._pool = [r for r in self._pool if id(r) not in gone]
        self._peeked, self._peeked_index = None, -1

    def __bool__(self) -> bool:
        return bool(self._front) or bool(self._pool)

    def __len__(self) -> int:
        return len(self._front) + len(self._pool)

    def __iter__(self) -> Iterator[Request]:
        yield from self._front
        yield from self._pool


def _decoder(tokenizer: Any) -> Decoder | None:
    if tokenizer is None:
        return None

    def decode(token_ids: Sequence[int], skip_special_tokens: bool) -> str:
        return str(tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    return decode


class _CarbonForgeMixin:
    """The hooks, shared by the synchronous and the asynchronous variants."""

    # Attributes of vLLM's Scheduler this mixin uses (declared for the type checker).
    running: list[Request]
    requests: dict[str, Request]
    waiting: Any
    kv_holding_waiting: Any
    finished_req_ids: set[str]
    kv_cache_manager: Any
    structured_output_manager: Any

    _cf_writer: TraceWriter | None = None
    _cf_steps: StepLog | None = None
    _cf_pacer: Pacer | None = None
    _cf_stopping = False
    #: The clock of the request times (arrival, admission, first token, completion). The twin
    #: (:mod:`carbonforge_runtime.engine.twin`) replaces it, and its waiting queue's, with virtual time.
    _cf_clock: Callable[[], float] = staticmethod(time.time)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        try:
            contract = EngineContract.from_environ(os.environ)
        except ContractError as exc:
            log.error("CarbonForge scheduler cannot start: %s; %s", exc.message, exc.remedy)
            raise
        self._cf_contract = contract
        self._cf_family_name = contract.ordering.family
        self._cf_family: Family = make_family(contract.ordering.family, contract.ordering.params)
        #: The tenants' fair-share counters and who waits (core/ordering/tenancy.py).
        self._cf_ledger = Ledger(read_fairness(contract.ordering.family, contract.ordering.params))
        #: During one schedule(): prompt tokens each tenant over its share may still get (prefill_budget.py).
        self._cf_prefill_left: dict[str, int] = {}
        #: A family that keeps vLLM's queue swaps in the scored queue once a second tenant (with
        #: fairness on) or a second priority class arrives: (tenant, class) of the first request.
        self._cf_first_tenancy: tuple[str, int] | None = None
        self._cf_live: dict[str, _Live] = {}
        self._cf_pending_first: list[_Live] = []
        self._cf_writer: TraceWriter | None = None
        self._cf_energy: EnergyMeter | None = None  # energy_j per request (only with NVML)
        self._cf_counters = EngineCounters()
        self._cf_full = False
        self._cf_stopping = False
        self._cf_abort_at: float | None = None  # monotonic time to end what still runs, once stopping
        if contract.builds_records:
            self._cf_writer = self._cf_start_writer(contract)
            self._cf_counters = self._cf_writer.counters
        self._cf_steps: StepLog | None = None
        if contract.step_log is not None:
            self._cf_steps = start_step_log(contract.step_log, self, log, VLLM_VERSION, contract.emulation)
        #: serve --emulate: every step paced to the step-time model (engine/pacing.py).
        self._cf_pacer = start_pacer(contract.emulation, self._cf_counters, log)
        if self._cf_writer is not None or self._cf_steps is not None or self._cf_pacer is not None:
            atexit.register(self._cf_close)
        self._cf_watch_shutdown_signal()
        # Per-request bookkeeping only when something consumes it.
        self._cf_track = self._cf_writer is not None or self._cf_family.reorders
        if self._cf_family.reorders:
            self.waiting = self._cf_scored_queue()
        base = "AsyncScheduler" if isinstance(self, AsyncScheduler) else "Scheduler"
        trace = contract.tracing
        log.info(
            "CarbonForge scheduler on vLLM %s: family %s (%s), request trace %s%s, step log %s",
            base, self._cf_family_name,
            "reorders the waiting queue" if self._cf_family.reorders else "vLLM's order",
            trace.level if trace else "off",
            f" to {', '.join(w.sink.name for w in self._cf_writer.workers)}" if self._cf_writer else "",
            contract.step_log.file if contract.step_log else "off",
        )

    def _cf_start_writer(self, contract: EngineContract) -> TraceWriter:
        trace = contract.tracing
        decode = None
        if trace is not None and trace.full:
            self._cf_full = True
            decode = _decoder(getattr(self.structured_output_manager, "tokenizer", None))
            if decode is None:
                log.warning("request trace full: the engine has no tokenizer (--skip-tokenizer-init), so "
                            "prompt_text and output_text are null")
            log.warning("\n%s", "\n".join("!! " + line for line in full_level_banner_lines(trace)))
        # Without a trace (the metrics feed alone) records are built at the standard level, and the
        # writer runs with the default limits.
        limits = trace if trace is not None else TraceConfig(level=LEVEL_STANDARD)
        build: Callable[[Any], Any] = functools.partial(
            build_record, family=self._cf_family_name, level=limits.level, decode=decode
        )
        self._cf_energy = start_meter(contract.energy_meter, log)
        if self._cf_energy is not None:
            build = self._cf_energy.wrap_build(build)
        writer = TraceWriter(build_sinks(trace, contract.metrics_feed, self._cf_dp_rank()), build, limits, log).start()
        attach_feed(writer)  # the runtime's metrics feed, when it asked for one
        return writer

    def _cf_dp_rank(self) -> int:
        """This engine core's data-parallel rank. vLLM runs each rank of a dense model as an
        independent engine (its ``data_parallel_rank`` reset to 0) and keeps the rank in
        ``data_parallel_index``."""
        config = getattr(getattr(self, "vllm_config", None), "parallel_config", None)
        rank = getattr(config, "data_parallel_index", None)
        if not isinstance(rank, int):
            rank = getattr(config, "data_parallel_rank", 0)
        return rank if isinstance(rank, int) and rank >= 0 else 0

    def _cf_watch_shutdown_signal(self) -> None:
        """Learn that the engine is shutting down: wrap the SIGTERM handler vLLM's engine-core
        process installed (it starts the drain), without changing what it does."""
        if threading.current_thread() is not threading.main_thread():
            return
        previous = signal.getsignal(signal.SIGTERM)
        if not callable(previous):
            return  # no engine-core handler to wrap (e.g. a scheduler built outside vLLM's engine)

        flush_s = self._cf_writer.config.flush_timeout_s if self._cf_writer is not None else 0.0

        def on_sigterm(signum: int, frame: Any) -> None:
            if not self._cf_stopping:
                self._cf_stopping = True
                timeout_s = float(getattr(getattr(self, "vllm_config", None), "shutdown_timeout", 0) or 0)
                self._cf_abort_at = time.monotonic() + abort_delay(timeout_s, flush_s)
            if self._cf_writer is not None:
                self._cf_writer.hurry()
            if self._cf_steps is not None:
                self._cf_steps.hurry()
            previous(signum, frame)

        signal.signal(signal.SIGTERM, on_sigterm)

    def _cf_scored_queue(self) -> ScoredQueue:
        queue = ScoredQueue(self._cf_family, self._cf_live, self._cf_cached_tokens, self._cf_clock, self._cf_ledger)
        queue.sync_service = self._cf_sync_service
        queue.prefill_left = self._cf_prefill_left
        return queue

    def _cf_watch_tenancy(self, request: Request) -> None:
        """vLLM's own queue until requests of two tenants (fairness on) or two priority classes wait;
        then the scored queue, holding what waits in the same order, for good."""
        params = request.sampling_params
        tenant, priority, _ = tenancy_of(params.extra_args if params is not None else None)
        if not self._cf_ledger.fairness.on:
            tenant = ""
        first = self._cf_first_tenancy
        if first is None:
            self._cf_first_tenancy = (tenant, priority)
            return
        if first == (tenant, priority):
            return
        queue = self._cf_scored_queue()
        self._cf_track = True
        for waiting in self.waiting:
            if waiting.request_id not in self._cf_live:
                self._cf_live[waiting.request_id] = _Live(waiting)
            queue.add_request(waiting)
        for running in self.running:  # the tenants already served count for the prompt budgets too
            params = running.sampling_params
            tenant, _, share = tenancy_of(params.extra_args if params is not None else None)
            self._cf_ledger.shares.setdefault(tenant, share)
        self.waiting = queue
        log.info("CarbonForge scheduler: requests of several tenants or priority classes: the waiting queue "
                 "now orders by priority class%s, then %s order",
                 ", then the least-served tenant" if self._cf_ledger.fairness.on else "", self._cf_family_name)

    def _cf_sync_service(self) -> None:
        """Count the output tokens generated since the last call to their tenants' counters."""
        ledger = self._cf_ledger
        live = self._cf_live
        for request in self.running:
            state = live.get(request.request_id)
            if state is None or state.charged_output < 0 or state.waiting is None:
                continue
            generated = request.num_output_tokens
            if generated > state.charged_output:
                ledger.charge(state.waiting.tenant, state.waiting.share, output_tokens=generated - state.charged_output)
                state.charged_output = generated

    def _cf_tenant(self, request: Request) -> str:
        state = self._cf_live.get(request.request_id)
        if state is not None and state.waiting is not None:
            return state.waiting.tenant
        params = request.sampling_params
        return tenancy_of(params.extra_args if params is not None else None)[0]

    def _cf_cap_prefill(self, budgets: dict[str, int]) -> None:
        """Before a step, with several tenants seen: the prompt budgets of the tenants over their share."""
        ledger = self._cf_ledger
        running: dict[str, int] = {}
        for request in self.running:
            tenant = self._cf_tenant(request)
            running[tenant] = running.get(tenant, 0) + 1
        shares = ledger.shares
        with_work = {tenant: shares.get(tenant, 1.0) for tenant in running}
        for _, tenant in ledger.waiting:
            with_work[tenant] = shares.get(tenant, 1.0)
        budgets.update(prefill_budgets(running, with_work, ledger.fairness.prefill_tokens))

    def _reserve_prefill_lookahead(self, request: Request, num_computed_tokens: int, num_new_tokens: int) -> int:
        """vLLM 0.32 sizes every chunk it schedules (running and newly admitted requests) through this
        method last, and skips a request given 0 tokens; here a capped tenant's prompt chunk is cut
        to what is left of its step budget (core/ordering/prefill_budget.py)."""
        num_new_tokens = super()._reserve_prefill_lookahead(  # type: ignore[misc]
            request, num_computed_tokens, num_new_tokens)
        budgets = self._cf_prefill_left
        if budgets and num_new_tokens > 0 and is_prefill(num_computed_tokens, request.num_tokens):
            tenant = self._cf_tenant(request)
            left = budgets.get(tenant)
            if left is not None:
                num_new_tokens = grant(left, num_new_tokens)
                budgets[tenant] = left - num_new_tokens
        return int(num_new_tokens)

    def _cf_cached_tokens(self, request: Request) -> int:
        if request.num_computed_tokens:
            return int(request.num_computed_tokens)
        return int(self.kv_cache_manager.get_computed_blocks(request)[1])

    # --- hooks -------------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        steps = self._cf_steps
        if steps is not None and request.request_id in self.requests:
            steps = None  # a streaming session's next input, not a new request
        super().add_request(request)  # type: ignore[misc]
        if steps is not None:  # when it entered the scheduler, against its arrival stamp (step_log.py)
            steps.added(request.arrival_time, request.num_prompt_tokens, time.time(), time.monotonic())
        if self._cf_track and request.request_id not in self._cf_live and not request.is_finished():
            self._cf_live[request.request_id] = _Live(request)
        self._cf_counters.requests_arrived_total += 1
        if not self._cf_family.reorders and not isinstance(self.waiting, ScoredQueue):
            self._cf_watch_tenancy(request)

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        steps = self._cf_steps
        pacer = self._cf_pacer
        entered = time.monotonic() if steps is not None or pacer is not None else 0.0
        budgets = self._cf_prefill_left
        fairness = self._cf_ledger.fairness
        if fairness.on and fairness.prefill_tokens and len(self._cf_ledger.shares) > 1:
            self._cf_cap_prefill(budgets)
        try:
            output = super().schedule(*args, **kwargs)  # type: ignore[misc]
        finally:
            budgets.clear()
        if steps is not None:
            steps.scheduled(output, entered)
        if pacer is not None:
            pacer.scheduled(output, entered)
        energy = self._cf_energy
        if energy is not None:
            energy.step_started(output, time.monotonic())
        counters = self._cf_counters
        counters.steps += 1
        counters.tokens_scheduled_total += output.total_num_scheduled_tokens
        counters.running = len(self.running)
        counters.waiting = len(self.waiting) + len(self.kv_holding_waiting)
        new_reqs = output.scheduled_new_reqs
        if self._cf_track and new_reqs:
            now = self._cf_clock()
            live = self._cf_live
            for new in new_reqs:
                state = live.get(new.req_id)
                if state is not None and state.t_scheduled is None:
                    state.t_scheduled = now
                    state.cached_prompt_tokens = new.num_computed_tokens
                    state.priority_score = state.peek_score
                    self._cf_pending_first.append(state)
        return output

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        outputs = super().update_from_output(scheduler_output, model_runner_output)  # type: ignore[misc]
        if self._cf_pacer is not None:  # sleeps out the step's modelled time before its outputs leave
            self._cf_pacer.finish(scheduler_output, self.get_num_unfinished_requests() > 0)  # type: ignore[attr-defined]
        steps = self._cf_steps
        energy = self._cf_energy
        if steps is not None or energy is not None:
            step_end = time.monotonic()
            busy = self.get_num_unfinished_requests() > 0  # type: ignore[attr-defined]
            if steps is not None:
                steps.updated(scheduler_output, step_end, busy)
            if energy is not None:
                energy.step_ended(scheduler_output, step_end, scheduler_output.num_scheduled_tokens, busy)
        if self._cf_track:
            waiting = self.waiting
            if waiting.__class__ is ScoredQueue:
                waiting.service_stale = True
            now = self._cf_clock()
            pending = self._cf_pending_first
            if pending:
                still: list[_Live] = []
                for state in pending:
                    if state.done:
                        continue
                    if state.request.num_output_tokens > 0:
                        state.t_first_token = now
                    else:
                        still.append(state)
                self._cf_pending_first = still
            live = self._cf_live
            for request_id in self.finished_req_ids:
                ended: _Live | None = live.pop(request_id, None)
                if ended is not None:
                    self._cf_complete(ended, now)
        abort_at = self._cf_abort_at
        if abort_at is not None and time.monotonic() >= abort_at:
            self._cf_abort_at = None
            self._cf_abort_leftovers(outputs)
        return outputs

    def _cf_abort_leftovers(self, outputs: dict[int, EngineCoreOutputs]) -> None:
        """The drain deadline is near: end every unfinished request as an abort, as vLLM does
        for a shutdown without a drain, and tell each client in this step's outputs."""
        aborted = self.finish_requests(None, RequestStatus.FINISHED_ABORTED)
        if not aborted:
            return
        log.warning("drain deadline near: ending %d request(s) still in flight as aborted, so each "
                    "gets its trace record and its client an answer", len(aborted))
        for request in aborted:
            eco = outputs.get(request.client_index)
            if eco is None:
                eco = outputs[request.client_index] = EngineCoreOutputs(outputs=[])
            eco.outputs.append(EngineCoreOutput(request.request_id, [], finish_reason=FinishReason.ABORT))
            if eco.finished_requests is None:
                eco.finished_requests = set()
            eco.finished_requests.add(request.request_id)

    def finish_requests(self, request_ids: Any, finished_status: RequestStatus) -> list[Request]:
        finished: list[Request] = super().finish_requests(request_ids, finished_status)  # type: ignore[misc]
        if self._cf_track and finished:
            now = self._cf_clock()
            live = self._cf_live
            for request in finished:
                state: _Live | None = live.pop(request.request_id, None)
                if state is not None:
                    self._cf_complete(state, now)
        return finished

    def has_requests(self) -> bool:
        """vLLM's answer; and once a shutdown was signalled and the last request is done, first
        write every queued record (bounded by the flush timeout).

        The engine leaves its loop when this is False, resets SIGTERM to the default action and
        tears down; the API server's second SIGTERM can end the process before ``shutdown()``
        runs, so the flush happens here, while the engine is still in its loop with no work left.
        """
        if super().has_requests():  # type: ignore[misc]
            return True
        if self._cf_stopping and (self._cf_writer is not None or self._cf_steps is not None):
            self._cf_close()
        return False

    def shutdown(self) -> None:
        """vLLM calls this after its executor has shut down. Once every record is written, one line
        (:data:`~carbonforge_runtime.core.contract.CORE_DONE_MARKER`) tells the runtime that this
        engine core holds nothing more: what is left of its exit may be skipped."""
        try:
            super().shutdown()  # type: ignore[misc]
        finally:
            self._cf_close()
        if self._cf_stopping:
            log.info("%s %d", CORE_DONE_MARKER, os.getpid())

    # --- completion ----------------------------------------------------------------------------

    def _cf_complete(self, state: _Live, now: float) -> None:
        state.done = True
        request = state.request
        self._cf_counters.requests_completed_total += 1
        finish_reason = _FINISH_REASON.get(request.status, "abort")
        charged = state.charged_output
        if charged >= 0 and state.waiting is not None and request.num_output_tokens > charged:
            self._cf_ledger.charge(state.waiting.tenant, state.waiting.share,
                                   output_tokens=request.num_output_tokens - charged)
            state.charged_output = request.num_output_tokens
        # Only natural ends teach the ranker: an aborted request's length says when the client left.
        if state.waiting is not None and finish_reason in ("stop", "length"):
            try:
                self._cf_family.observe(state.waiting, request.num_output_tokens)
            except Exception as exc:  # a family's bug must not stop the engine
                log.warning("scheduler family %s failed to observe a completion: %s",
                            self._cf_family_name, exc)
        writer = self._cf_writer
        if writer is None:
            return
        full = self._cf_full
        params = request.sampling_params
        extra = params.extra_args if params is not None else None
        writer.submit(Completion(
            engine_request_id=request.request_id,
            t_arrival=request.arrival_time,
            t_scheduled=state.t_scheduled,
            t_first_token=state.t_first_token,
            t_completion=now,
            prompt_tokens=request.num_prompt_tokens,
            output_tokens=request.num_output_tokens,
            finish_reason=finish_reason,
            cached_prompt_tokens=state.cached_prompt_tokens,
            preemptions=request.num_preemptions,
            priority_score=state.priority_score,
            prompt_token_ids=request.prompt_token_ids if full else None,
            output_token_ids=request.output_token_ids if full else None,
            skip_special_tokens=params.skip_special_tokens if params is not None else True,
            tags_arg=extra.get(TAGS_ARG) if extra else None,
            model_arg=extra.get(MODEL_ARG) if extra else None,
            tenant_arg=extra.get(TENANT_ARG) if extra else None,
        ))

    def _cf_close(self) -> None:
        writer = self._cf_writer
        if writer is not None and not writer.closed:
            # The engine is going away with requests it never finished: each still gets a record,
            # as an abort (vLLM tells their clients nothing more either).
            now = self._cf_clock()
            for state in list(self._cf_live.values()):
                if not state.done:
                    self._cf_complete(state, now)
            self._cf_live.clear()
            writer.close()
        if self._cf_energy is not None:
            self._cf_energy.close()
        if self._cf_steps is not None:
            self._cf_steps.close()
        if self._cf_pacer is not None:
            self._cf_pacer.close()

    @property
    def cf_counters(self) -> EngineCounters:
        return self._cf_counters


class CarbonForgeScheduler(_CarbonForgeMixin, Scheduler):
    """On vLLM's synchronous scheduler (CPU, or async scheduling off)."""


class CarbonForgeAsyncScheduler(_CarbonForgeMixin, AsyncScheduler):
    """On vLLM's asynchronous scheduler (the GPU default), so the overlap is kept."""


def make_scheduler(*args: Any, **kwargs: Any) -> Scheduler:
    """What ``--scheduler-cls`` names: the variant matching the engine's async-scheduling setting."""
    vllm_config = kwargs.get("vllm_config", args[0] if args else None)
    async_on = bool(getattr(getattr(vllm_config, "scheduler_config", None), "async_scheduling", False))
    cls = CarbonForgeAsyncScheduler if async_on else CarbonForgeScheduler
    return cls(*args, **kwargs)
