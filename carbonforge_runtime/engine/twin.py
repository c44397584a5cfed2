"""The twin: vLLM's real scheduler, with our scheduler class and family, driven in virtual time.

No model runs. Each step, vLLM's own ``Scheduler.schedule()`` admits, chunks, allocates KV blocks,
finds prefix-cache hits and preempts, exactly as in the engine; a step-time model
(:func:`carbonforge_runtime.core.twin_data.step_time_s`) says how long the forward pass would take; a
hand-made model output hands each request whose prompt is complete one token (a request part-way
through its prompt gets none). Arrivals enter at step boundaries, as in the engine core, and no
sooner than the step-time model's host admission delay after their arrival stamp
(:func:`~carbonforge_runtime.core.twin_data.admission_delay_s`: the API server's rendering and
tokenisation and the hand-over to the engine core; zero unless the model has one). With
asynchronous scheduling (vLLM's GPU default) one step stays in flight: step k+1 is scheduled
before step k's output is applied, and starts when step k ends.

Stretches of steps whose course is known in advance (nothing can be admitted, every running
request decodes and none finishes) run at once, with vLLM's own functions called in the order the
step-by-step loop would call them; ``run_twin(..., fast_forward=False)`` keeps the step-by-step
loop, and the two give identical results.

Our scheduler's request clock and its waiting queue's clock read the virtual clock, so the
starvation guard ages requests in virtual time. A request's tenant and priority class travel as the
API server's middleware sends them (``vllm_xargs`` under the reserved keys), so the twin's queue
orders classes and tenants with the engine's own code. Results are identical across processes only with
``PYTHONHASHSEED=0`` (vLLM iterates sets of request ids); the command line pins it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

from carbonforge_runtime.core.contract import CONTRACT_ENV, EngineContract, Ordering
from carbonforge_runtime.core.request_tags import PRIORITY_ARG, TENANT_ARG
from carbonforge_runtime.core.twin_data import (
    Sample,
    SimError,
    SimOutcome,
    SimRequest,
    StepCostModel,
    TwinRun,
    TwinSettings,
    admission_delay_s,
)
from carbonforge_runtime.engine.scheduler import TRUE_OUTPUT_TOKENS_ARG, ScoredQueue, make_scheduler

#: Steps between two progress calls.
PROGRESS_EVERY_STEPS = 2000
#: The token every decoding request samples (ignore_eos: the length is max_tokens).
_SAMPLED_TOKEN = 7
#: Token ids of generated prompts stay below this (any id works: no model reads them).
_TOKEN_SPACE = 1 << 14
_FILLER = 999

_FINISH = {"FINISHED_STOPPED": "stop", "FINISHED_LENGTH_CAPPED": "length", "FINISHED_ABORTED": "abort",
           "FINISHED_IGNORED": "length", "FINISHED_ERROR": "error", "FINISHED_REPETITION": "repetition"}


def _model_dir(max_model_len: int) -> str:
    """A directory with a minimal model config.json: vLLM's ModelConfig reads nothing else when the
    tokenizer is skipped. The model's shape is irrelevant (the KV cache is given in tokens)."""
    directory = tempfile.mkdtemp(prefix="cf-twin-")
    config = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64,
              "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 1, "num_hidden_layers": 1,
              "vocab_size": _TOKEN_SPACE + 1024, "max_position_embeddings": max(max_model_len, 2048),
              "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16", "tie_word_embeddings": True}
    with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as handle:
        json.dump(config, handle)
    return directory


def _vllm_config(settings: TwinSettings, directory: str) -> Any:
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig

    model = ModelConfig(model=directory, tokenizer=directory, skip_tokenizer_init=True, dtype="bfloat16", seed=0,
                        max_model_len=settings.max_model_len)
    sched = SchedulerConfig(max_num_seqs=settings.max_num_seqs, max_num_batched_tokens=settings.max_num_batched_tokens,
                            max_model_len=settings.max_model_len, is_encoder_decoder=False,
                            enable_chunked_prefill=settings.enable_chunked_prefill,
                            long_prefill_token_threshold=settings.long_prefill_token_threshold)
    cache = CacheConfig(block_size=settings.block_size, cache_dtype="auto",
                        enable_prefix_caching=settings.enable_prefix_caching)
    cache.num_gpu_blocks = settings.kv_blocks
    config = VllmConfig(scheduler_config=sched, model_config=model, cache_config=cache,
                        device_config=DeviceConfig("cpu"))
    # The CPU platform turns these to its own values; the twin models the settings' engine.
    config.scheduler_config.async_scheduling = settings.async_scheduling
    config.scheduler_config.max_num_batched_tokens = settings.max_num_batched_tokens
    config.scheduler_config.max_num_seqs = settings.max_num_seqs
    config.scheduler_config.enable_chunked_prefill = settings.enable_chunked_prefill
    config.scheduler_config.long_prefill_token_threshold = settings.long_prefill_token_threshold
    config.cache_config.block_size = settings.block_size
    return config


def build_scheduler(settings: TwinSettings) -> tuple[Any, Callable[[Any], Any]]:
    """vLLM's scheduler (our class, the settings' family) without an executor, and the block hasher."""
    import torch
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    settings.validate()
    init_none_hash(sha256)
    blocks = settings.kv_blocks
    directory = _model_dir(settings.max_model_len)
    try:
        config = _vllm_config(settings, directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    kv = KVCacheConfig(num_blocks=blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["layer.0"], FullAttentionSpec(block_size=settings.block_size, num_kv_heads=1, head_size=64,
                                                        dtype=torch.bfloat16))])
    contract = EngineContract(Ordering(settings.family, dict(settings.params)), None).to_json()
    previous = os.environ.get(CONTRACT_ENV)
    os.environ[CONTRACT_ENV] = contract
    try:
        scheduler = make_scheduler(vllm_config=config, kv_cache_config=kv,
                                   structured_output_manager=StructuredOutputManager(config),
                                   block_size=settings.block_size, log_stats=False)
    finally:
        if previous is None:
            os.environ.pop(CONTRACT_ENV, None)
        else:
            os.environ[CONTRACT_ENV] = previous
    return scheduler, get_request_block_hasher(settings.block_size, sha256)


def block_tokens(block_id: int, size: int) -> list[int]:
    """The tokens of one content block: its id spelled in the first four tokens, then filler.
    Equal ids give equal tokens; different ids (below 2**56) give different ones."""
    head = [1000 + ((block_id >> shift) & (_TOKEN_SPACE - 1)) for shift in (0, 14, 28, 42)]
    return (head + [_FILLER] * size)[:size]


def prompt_tokens(request: SimRequest) -> list[int]:
    """The prompt's token ids: shared content blocks where ``blocks`` says so, otherwise a prompt
    that starts unlike any other request's (the index spelled out) and shares nothing."""
    if request.blocks is None or request.block_tokens < 1:
        return (block_tokens((1 << 55) | request.index, 4) + [_FILLER] * request.prompt_tokens)[:request.prompt_tokens]
    out: list[int] = []
    size = request.block_tokens
    for block_id in request.blocks:
        if len(out) >= request.prompt_tokens:
            break
        out.extend(block_tokens(block_id, size))
    position = len(out)
    while position < request.prompt_tokens:  # beyond the named blocks: content of this request alone
        out.extend(block_tokens((1 << 55) | (request.index << 20) | (position // size), size))
        position += size
    return out[:request.prompt_tokens]


class _Clock:
    __slots__ = ("now",)

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _can_fast_forward(scheduler: Any) -> bool:
    """Whether the scheduler is configured so that a decode step touches nothing but what
    :func:`run_twin`'s fast-forward reproduces (no drafts, connectors, pipeline or deferred frees)."""
    kv_groups = scheduler.kv_cache_manager.coordinator.single_type_managers
    return (getattr(scheduler, "num_spec_tokens", 1) == 0 and getattr(scheduler, "num_lookahead_tokens", 1) == 0
            and getattr(scheduler, "num_prefill_lookahead", 1) == 0
            and getattr(scheduler, "num_sampled_tokens_per_step", 0) == 1
            and not getattr(scheduler, "defer_block_free", True) and not getattr(scheduler, "use_pp", True)
            and not getattr(scheduler, "use_v2_model_runner", True) and scheduler.connector is None
            and getattr(scheduler, "ec_connector", None) is None and scheduler.lora_config is None
            and not getattr(scheduler, "log_stats", True) and len(kv_groups) == 1
            and getattr(scheduler, "_cf_steps", None) is None and getattr(scheduler, "_cf_energy", None) is None
            and getattr(scheduler, "_cf_writer", None) is None)


def run_twin(requests: Sequence[SimRequest], settings: TwinSettings, cost: StepCostModel,
             progress: Callable[[int, int, float], None] | None = None, *, fast_forward: bool = True) -> TwinRun:
    """Replay ``requests`` (in arrival order) through the scheduler; one outcome per request, in order.

    A request enters the scheduler at the first step boundary at or after its arrival plus the
    model's admission delay (its latencies still count from its arrival); with a delay that grows
    with the prompt, a short prompt may enter before a long one that arrived just before it.

    ``progress(completed, total, virtual_now)`` is called every :data:`PROGRESS_EVERY_STEPS` steps.

    ``fast_forward`` skips vLLM's per-request work in stretches of steps whose course is known in
    advance (see :func:`run_twin`'s ``skip_decode_steps``); the results are identical with it off,
    which the tests check.
    """
    from vllm.sampling_params import SamplingParams
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    scheduler, hasher = build_scheduler(settings)
    clock = _Clock()
    scheduler._cf_clock = clock
    if isinstance(scheduler.waiting, ScoredQueue):
        scheduler.waiting.clock = clock
    live: dict[str, Any] = getattr(scheduler, "_cf_live", {})
    kv_manager = scheduler.kv_cache_manager
    by_id = scheduler.requests

    outcomes = [SimOutcome(r.index, r.arrival_s, r.prompt_tokens, r.output_tokens, tenant=r.tenant,
                           priority=r.priority) for r in requests]
    open_requests: dict[str, tuple[SimOutcome, Any]] = {}
    run = TwinRun(outcomes)
    # Coefficients in seconds, read once.
    floor = cost.floor_ms / 1000.0
    per_token = cost.per_batched_token_ms / 1000.0
    per_kv = cost.per_kv_token_read_ms / 1000.0
    per_attention = cost.attention_ms / 1000.0
    overhead = cost.overhead_ms / 1000.0
    sample_every = settings.sample_every_s
    next_sample = 0.0

    total = len(requests)
    # When each request can enter, and the order in which they enter (ties in arrival order).
    if cost.has_admission_delay:
        ready = [r.arrival_s + admission_delay_s(cost, r.prompt_tokens) for r in requests]
        order = sorted(range(total), key=lambda i: (ready[i], i))
        ready_at = [ready[i] for i in order]
    else:
        order = list(range(total))
        ready_at = [r.arrival_s for r in requests]
    arrived = 0
    completed = 0
    steps = 0
    prefill_total = 0
    decode_total = 0
    busy = 0.0
    inflight: tuple[Any, Any, list[str], float] | None = None  # (output, runner output, sampled ids, end time)
    asynchronous = settings.async_scheduling
    idle_schedules = 0

    def admit(until: float) -> None:
        nonlocal arrived
        while arrived < total and ready_at[arrived] <= until:
            position = order[arrived]
            item = requests[position]
            rid = str(item.index)
            extra: dict[str, Any] = {TRUE_OUTPUT_TOKENS_ARG: item.output_tokens}
            if item.tenant is not None:
                extra[TENANT_ARG] = item.tenant
            if item.priority:
                extra[PRIORITY_ARG] = item.priority
            params = SamplingParams(max_tokens=item.output_tokens, ignore_eos=True, extra_args=extra)
            request = Request(rid, prompt_tokens(item), params, None, arrival_time=item.arrival_s,
                              block_hasher=hasher)
            open_requests[rid] = (outcomes[position], request)
            scheduler.add_request(request)
            arrived += 1

    def apply(output: Any, runner: Any, sampled: list[str]) -> None:
        nonlocal completed
        scheduler.update_from_output(output, runner)
        now = clock.now
        for rid in sampled:
            entry = open_requests.get(rid)
            if entry is not None and entry[0].first_token_s is None:
                entry[0].first_token_s = now
        for rid in scheduler.finished_req_ids:
            entry = open_requests.pop(rid, None)
            if entry is None:
                continue
            outcome, request = entry
            outcome.completion_s = now
            outcome.generated_tokens = request.num_output_tokens
            outcome.preemptions = request.num_preemptions
            outcome.finish_reason = _FINISH.get(request.status.name, "abort")
            completed += 1

    block_size = settings.block_size
    max_model_len = settings.max_model_len
    fast_forward = fast_forward and _can_fast_forward(scheduler)
    if fast_forward:
        from vllm.v1.request import RequestStatus

        running_status = RequestStatus.RUNNING
        block_table = kv_manager.coordinator.single_type_managers[0].req_to_blocks
        token_budget = min(scheduler.max_num_scheduled_tokens, settings.max_num_batched_tokens)
        running_cap = scheduler.max_num_active_reqs
        counters = getattr(scheduler, "_cf_counters", None)
        free_blocks = kv_manager.block_pool.get_num_free_blocks

    def skip_decode_steps() -> bool:
        """Run the next steps at once when each is known to be a plain decode step.

        Called where the loop would call ``schedule()``. A stretch qualifies when nothing can be
        admitted (no request waits, or the running batch is full), every running request is
        decoding and has already had its first token, the step in flight (asynchronous
        scheduling) decoded exactly the running batch, and no request reaches its last token
        before the stretch ends. Then each of the next steps gives every running request one
        token, and vLLM's own state changes only in three ways: each request's tokens and
        counters grow by one, a request crossing a block boundary gets a new block, and a block
        that fills is cached. The first is applied at once per request (vLLM's
        ``append_output_token_ids`` with a list, so the block hashes are vLLM's); the other two
        go through vLLM's ``allocate_slots`` in the same order the plain loop calls it (step by
        step, in running order), with the request's state as it would be at that moment, so the
        same blocks go to the same requests and the same cached blocks are evicted. The clock,
        the busy time, the samples and the progress calls advance step by step in the plain
        loop's float order. The stretch stops before a step that would need more free blocks
        than there are (the plain loop would preempt), before an arrival that could be admitted,
        and before any request's last token. Returns whether any step was taken.
        """
        nonlocal inflight, steps, decode_total, busy, next_sample, idle_schedules
        running = scheduler.running
        n = len(running)
        if not n or n > token_budget or scheduler.finished_req_ids or scheduler.reset_preempted_req_ids:
            return False
        full = n >= running_cap
        if not full and (scheduler.waiting or scheduler.kv_holding_waiting):
            return False
        if scheduler.num_waiting_for_streaming_input or getattr(scheduler, "_cf_pending_first", None):
            return False
        if asynchronous:
            if inflight is None:
                return False
            counts = inflight[0].num_scheduled_tokens
            if len(counts) != n or len(inflight[2]) != n or inflight[0].scheduled_spec_decode_tokens:
                return False
            placeholders = 1
        else:
            placeholders = 0
        most = 1 << 30
        context = 0
        for request in running:
            computed = request.num_computed_tokens
            tokens = len(request._all_token_ids)
            if (request.status is not running_status or request.is_prefill_chunk or request.spec_token_ids
                    or request.num_output_placeholders != placeholders or request.num_stale_output_tokens
                    or request.num_in_flight_tokens != placeholders or request.num_output_tokens < 1
                    or tokens != computed + 1 - placeholders or computed < request.num_prompt_tokens
                    or len(block_table[request.request_id]) != -(-computed // block_size)):
                return False
            if asynchronous and counts.get(request.request_id) != 1:
                return False
            left = min(request.max_tokens - request.num_output_tokens, max_model_len - tokens) - 1
            if left < most:
                most = left
                if most < 2:
                    return False
            context += computed
        if asynchronous and list(counts) != [r.request_id for r in running]:
            return False
        # Steps (1-based) at which a request's allocate_slots call changes something: a new block
        # (the computed tokens reach a block boundary) or a block to cache (one token short of it,
        # synchronous scheduling). The other calls find nothing to do.
        events: list[list[int]] = [[] for _ in range(most + 1)]
        news: list[int] = [0] * (most + 1)
        for index, request in enumerate(running):
            computed = request.num_computed_tokens
            first = block_size - computed % block_size if computed % block_size else 0
            for start, is_new in ((first, True), (first - 1 if first else block_size - 1, False)):
                step = start + 1
                while step <= most:
                    events[step].append(index)
                    if is_new:
                        news[step] += 1
                    step += block_size
        base = [(r.num_computed_tokens, len(r._all_token_ids)) for r in running]
        done = [0] * n  # steps already applied to each request
        batched = n
        fixed = max(floor, per_token * batched)
        taken = 0
        for step in range(1, most + 1):
            if step > 1 and arrived < total and ready_at[arrived] <= clock.now:
                if not full:
                    break
                admit(clock.now)
            if news[step] > free_blocks():
                break
            for index in events[step]:
                request = running[index]
                computed, tokens = base[index]
                behind = step - 1 - done[index]
                if behind:
                    request.append_output_token_ids([_SAMPLED_TOKEN] * behind)
                    done[index] = step - 1
                request.num_computed_tokens = computed + step - 1
                if kv_manager.allocate_slots(request, 1) is None:  # cannot happen: the blocks were counted
                    raise SimError("fast-forward could not allocate a block", "run with fast_forward off")
            kv_read = context + n * (step - 1)
            step_s = fixed + per_kv * kv_read + per_attention * 0.0 + overhead
            steps += 1
            decode_total += n
            busy += step_s
            idle_schedules = 0
            if asynchronous:
                assert inflight is not None
                start = max(clock.now, inflight[3])
                clock.now = start
                inflight = (inflight[0], inflight[1], inflight[2], start + step_s)
            else:
                clock.now += step_s
            taken = step
            if clock.now >= next_sample:
                waiting = len(scheduler.waiting) + len(scheduler.kv_holding_waiting)
                run.samples.append(Sample(round(clock.now, 6), round(kv_manager.usage, 6), n, waiting))
                next_sample = clock.now + sample_every
            if progress is not None and steps % PROGRESS_EVERY_STEPS == 0:
                progress(completed, total, clock.now)
        if not taken:
            return False
        for index, request in enumerate(running):
            behind = taken - done[index]
            if behind:
                request.append_output_token_ids([_SAMPLED_TOKEN] * behind)
            request.num_computed_tokens = base[index][0] + taken
        if asynchronous:
            for request in running:
                request.spec_token_ids = scheduler._spec_token_placeholders
        scheduler.current_step += taken
        scheduler.prev_step_scheduled_req_ids.clear()
        scheduler.prev_step_scheduled_req_ids.update(r.request_id for r in running)
        kv_manager.take_new_block_ids()
        if counters is not None:
            counters.steps += taken
            counters.tokens_scheduled_total += n * taken
        return True

    while True:
        admit(clock.now)
        if not scheduler.has_requests():
            if inflight is not None:
                clock.now = max(clock.now, inflight[3])
                apply(inflight[0], inflight[1], inflight[2])
                inflight = None
                continue
            if arrived >= total:
                break
            clock.now = max(clock.now, ready_at[arrived])
            continue
        if fast_forward and skip_decode_steps():
            continue
        output = scheduler.schedule()
        steps += 1
        now = clock.now
        for new in output.scheduled_new_reqs:
            entry = open_requests.get(new.req_id)
            if entry is not None and entry[0].scheduled_s is None:
                entry[0].scheduled_s = now
                entry[0].cached_prompt_tokens = new.num_computed_tokens
                state = live.get(new.req_id)
                if state is not None:
                    entry[0].priority_score = state.priority_score
        ids: list[str] = []
        sampled_tokens: list[list[int]] = []
        sampled: list[str] = []
        kv_read = 0
        attention = 0.0
        prefill = 0
        decode = 0
        for rid, n in output.num_scheduled_tokens.items():
            request = by_id[rid]
            ids.append(rid)
            context = request.num_computed_tokens - n
            if n == 1 and context >= request.num_prompt_tokens:
                kv_read += context
                decode += 1
            else:
                attention += n * (context + n / 2)
                prefill += n
            if request.is_prefill_chunk:
                sampled_tokens.append([])
            else:
                sampled_tokens.append([_SAMPLED_TOKEN])
                sampled.append(rid)
        batched = output.total_num_scheduled_tokens
        if batched:
            idle_schedules = 0
            step_s = max(floor, per_token * batched) + per_kv * kv_read + per_attention * attention + overhead
        else:
            step_s = 0.0
            idle_schedules += 1
            if idle_schedules > 2 and inflight is None and not scheduler.finished_req_ids:
                if arrived < total:
                    clock.now = max(clock.now, ready_at[arrived])
                    idle_schedules = 0
                else:
                    raise SimError(
                        f"the engine can schedule none of its {len(scheduler.waiting)} waiting request(s) "
                        f"at virtual time {clock.now:.1f} s (KV cache of {settings.kv_tokens} tokens too small?)",
                        "raise --kv-tokens or lower --max-model-len")
        prefill_total += prefill
        decode_total += decode
        busy += step_s
        runner = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                   sampled_token_ids=sampled_tokens, logprobs=None, prompt_logprobs_dict={},
                                   pooler_output=[])
        if asynchronous:
            start = clock.now if inflight is None else max(clock.now, inflight[3])
            if inflight is not None:
                clock.now = max(clock.now, inflight[3])
                apply(inflight[0], inflight[1], inflight[2])
            inflight = (output, runner, sampled, start + step_s)
        else:
            clock.now += step_s
            apply(output, runner, sampled)
        if clock.now >= next_sample:
            waiting = len(scheduler.waiting) + len(getattr(scheduler, "kv_holding_waiting", ()))
            run.samples.append(Sample(round(clock.now, 6), round(kv_manager.usage, 6), len(scheduler.running), waiting))
            next_sample = clock.now + sample_every
        if progress is not None and steps % PROGRESS_EVERY_STEPS == 0:
            progress(completed, total, clock.now)

    run.steps = steps
    run.makespan_s = clock.now
    run.busy_s = busy
    run.prefill_tokens = prefill_total
    run.decode_tokens = decode_total
    if progress is not None:
        progress(completed, total, clock.now)
    return run


#: Requests of the burst that measures capacity (the trace's first ones).
CAPACITY_BURST = 2000


def measure_capacity(requests: Sequence[SimRequest], settings: TwinSettings, cost: StepCostModel) -> float:
    """Steady-state capacity in requests a second: the first :data:`CAPACITY_BURST` requests all
    arrive at once, and the completion rate between the 10th and the 90th percentile completion
    is the capacity (requests / makespan would understate it, counting the ramp and the tail).

    The host's admission delay is left out: it moves when requests enter, not how fast the engine
    serves them, and with a per-token term it would reorder the burst by prompt length."""
    burst = [SimRequest(r.index, 0.0, r.prompt_tokens, r.output_tokens, r.blocks, r.block_tokens)
             for r in requests[:CAPACITY_BURST]]
    run = run_twin(burst, settings, cost.without_admission_delay())
    done = sorted(o.completion_s for o in run.outcomes if o.completion_s is not None)
    if len(done) < 10:
        raise SimError(f"too few requests ({len(done)}) to measure capacity", "pass at least 10 requests with --load")
    low, high = done[len(done) // 10], done[(len(done) * 9) // 10]
    if high <= low:
        return len(done) / max(run.makespan_s, 1e-9)
    return ((len(done) * 9) // 10 - len(done) // 10) / (high - low)
