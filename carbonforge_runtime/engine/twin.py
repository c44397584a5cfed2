"""The twin: vLLM's real scheduler, with our scheduler class and family, driven in virtual time.

No model runs. Each step, vLLM's own ``Scheduler.schedule()`` admits, chunks, allocates KV blocks,
finds prefix-cache hits and preempts, exactly as in the engine; a step-time model
(:func:`carbonforge_runtime.core.twin.step_time_s`) says how long the forward pass would take; a
hand-made model output hands each request whose prompt is complete one token (a request part-way
through its prompt gets none). Arrivals enter at step boundaries, as in the engine core. With
asynchronous scheduling (vLLM's GPU default) one step stays in flight: step k+1 is scheduled
before step k's output is applied, and starts when step k ends.

Our scheduler's request clock and its waiting queue's clock read the virtual clock, so the
starvation guard ages requests in virtual time. Results are identical across processes only with
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
from carbonforge_runtime.core.twin import Sample, SimError, SimOutcome, SimRequest, StepCostModel, TwinRun, TwinSettings
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


def run_twin(requests: Sequence[SimRequest], settings: TwinSettings, cost: StepCostModel,
             progress: Callable[[int, int, float], None] | None = None) -> TwinRun:
    """Replay ``requests`` (in arrival order) through the scheduler; one outcome per request, in order.

    ``progress(completed, total, virtual_now)`` is called every :data:`PROGRESS_EVERY_STEPS` steps.
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

    outcomes = [SimOutcome(r.index, r.arrival_s, r.prompt_tokens, r.output_tokens) for r in requests]
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
        while arrived < total and requests[arrived].arrival_s <= until:
            item = requests[arrived]
            rid = str(item.index)
            params = SamplingParams(max_tokens=item.output_tokens, ignore_eos=True,
                                    extra_args={TRUE_OUTPUT_TOKENS_ARG: item.output_tokens})
            request = Request(rid, prompt_tokens(item), params, None, arrival_time=item.arrival_s,
                              block_hasher=hasher)
            open_requests[rid] = (outcomes[arrived], request)
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
            clock.now = max(clock.now, requests[arrived].arrival_s)
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
                    clock.now = max(clock.now, requests[arrived].arrival_s)
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
    is the capacity (requests / makespan would understate it, counting the ramp and the tail)."""
    burst = [SimRequest(r.index, 0.0, r.prompt_tokens, r.output_tokens, r.blocks, r.block_tokens)
             for r in requests[:CAPACITY_BURST]]
    run = run_twin(burst, settings, cost)
    done = sorted(o.completion_s for o in run.outcomes if o.completion_s is not None)
    if len(done) < 10:
        raise SimError(f"too few requests ({len(done)}) to measure capacity", "pass at least 10 requests with --load")
    low, high = done[len(done) // 10], done[(len(done) * 9) // 10]
    if high <= low:
        return len(done) / max(run.makespan_s, 1e-9)
    return ((len(done) * 9) // 10 - len(done) // 10) / (high - low)
