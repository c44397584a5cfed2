"""The twin's loop against hand-computed cases (issue 16, acceptance 1).

Every step costs exactly 10 ms (a floor and nothing else), so times can be worked out by hand.
Admission, chunking, KV blocks, prefix-cache hits and preemption are vLLM's own scheduler's.
"""

from __future__ import annotations

import dataclasses
import time

import pytest

pytest.importorskip("vllm")

from carbonforge_runtime.core.twin_data import SimRequest, StepCostModel, TwinSettings
from carbonforge_runtime.engine.twin import prompt_tokens, run_twin

STEP = 0.010
FLAT = StepCostModel(name="flat", version=1, gpu="test", tensor_parallel_size=1, floor_ms=STEP * 1000,
                     per_batched_token_ms=0.0, per_kv_token_read_ms=0.0, attention_ms=0.0, overhead_ms=0.0,
                     kv_capacity_tokens=16_000, provenance="test")


def settings(**changes: object) -> TwinSettings:
    base: dict[str, object] = dict(family="fcfs", params={}, max_num_seqs=8, max_num_batched_tokens=32,
                                   max_model_len=4096, kv_tokens=16_000, async_scheduling=False)
    base.update(changes)
    return TwinSettings(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize("asynchronous", [False, True])
def test_chunked_prefill_gives_no_token_before_the_prompt_is_complete(asynchronous: bool) -> None:
    # 100 prompt tokens at 32 a step: chunks of 32, 32, 32 and 4; the first token comes with the
    # fourth step (t = 40 ms), then one decode step per further token.
    run = run_twin([SimRequest(0, 0.0, 100, 3)], settings(async_scheduling=asynchronous), FLAT)
    (o,) = run.outcomes
    assert o.scheduled_s == 0.0
    assert o.first_token_s == pytest.approx(4 * STEP)
    assert o.completion_s == pytest.approx(6 * STEP)
    assert o.generated_tokens == 3 and o.finish_reason == "length"
    assert run.prefill_tokens == 100 and run.decode_tokens == 2


def test_two_prompts_share_the_token_budget_and_arrivals_wait_for_a_step_boundary() -> None:
    # Step 1 (0-10 ms): 32 of A. Step 2: A's last 8 + 24 of B -> A's first token at 20 ms.
    # Step 3: A decodes, B's last 16 -> B's first token at 30 ms. C arrives at 25 ms, mid-step 3,
    # and enters at the next boundary (30 ms).
    reqs = [SimRequest(0, 0.0, 40, 2), SimRequest(1, 0.0, 40, 2), SimRequest(2, 0.025, 8, 1)]
    run = run_twin(reqs, settings(), FLAT)
    a, b, c = run.outcomes
    assert a.first_token_s == pytest.approx(2 * STEP) and a.completion_s == pytest.approx(3 * STEP)
    assert b.scheduled_s == pytest.approx(1 * STEP) and b.first_token_s == pytest.approx(3 * STEP)
    assert c.scheduled_s == pytest.approx(3 * STEP) and c.completion_s == pytest.approx(4 * STEP)


def test_preemption_comes_from_vllms_block_allocation() -> None:
    # 10 KV blocks of 16 tokens; two requests of 48 prompt + 60 output tokens each need 7 blocks:
    # both start, and when the blocks run out vLLM preempts one (recompute) and resumes it later.
    reqs = [SimRequest(0, 0.0, 48, 60), SimRequest(1, 0.0, 48, 60)]
    run = run_twin(reqs, settings(kv_tokens=160, max_num_batched_tokens=256), FLAT)
    assert sum(o.preemptions for o in run.outcomes) >= 1
    assert all(o.generated_tokens == 60 and o.finish_reason == "length" for o in run.outcomes)
    first, second = sorted(run.outcomes, key=lambda o: o.completion_s or 0)
    assert first.preemptions == 0 and second.preemptions >= 1


def test_prefix_cache_hits_come_from_vllms_cache() -> None:
    # A's prompt is blocks 1..5 (80 tokens). B, later, repeats all five: vLLM recomputes the last
    # token, so 64 tokens (4 blocks of 16) are a hit. C shares the first two blocks: 32 tokens.
    # D shares nothing.
    blocks = (1, 2, 3, 4, 5)
    reqs = [SimRequest(0, 0.0, 80, 2, blocks, 16), SimRequest(1, 1.0, 80, 2, blocks, 16),
            SimRequest(2, 2.0, 80, 2, (1, 2, 9, 10, 11), 16), SimRequest(3, 3.0, 80, 2)]
    run = run_twin(reqs, settings(max_num_batched_tokens=256), FLAT)
    assert [o.cached_prompt_tokens for o in run.outcomes] == [0, 64, 32, 0]
    assert prompt_tokens(reqs[0]) == prompt_tokens(reqs[1])
    assert prompt_tokens(reqs[2])[:32] == prompt_tokens(reqs[0])[:32] != prompt_tokens(reqs[2])[32:64]


def test_prefix_cache_off_gives_no_hits() -> None:
    blocks = (1, 2, 3)
    reqs = [SimRequest(0, 0.0, 48, 2, blocks, 16), SimRequest(1, 1.0, 48, 2, blocks, 16)]
    run = run_twin(reqs, settings(enable_prefix_caching=False, max_num_batched_tokens=256), FLAT)
    assert [o.cached_prompt_tokens for o in run.outcomes] == [0, 0]


@pytest.mark.parametrize("bound_s", [None, 5.0])
def test_the_aging_guard_reads_virtual_time(bound_s: float | None) -> None:
    # One sequence at a time. R runs for 10 virtual seconds (1,000 tokens at 10 ms). Meanwhile a long
    # prompt L and five short ones S wait; shortest-prompt-first serves the short ones first unless
    # L has waited longer than max_overtake_s by then (5 s here, in virtual time: the whole run
    # takes far less wall time, so a guard reading the wall clock would never fire).
    params = {"aging_rate": 0.0, "count_cached": False}
    if bound_s is not None:
        params["max_overtake_s"] = bound_s
    else:
        params["max_overtake_s"] = 1e9
    reqs = [SimRequest(0, 0.0, 16, 1000), SimRequest(1, 0.001, 200, 5)]
    reqs += [SimRequest(2 + i, 0.002 + i * 0.001, 16, 5) for i in range(5)]
    wall = time.monotonic()
    run = run_twin(reqs, settings(family="ltr-promptlen", params=params, max_num_seqs=1, max_num_batched_tokens=256),
                   FLAT)
    assert time.monotonic() - wall < 5.0
    long_prompt = run.outcomes[1]
    shorts = run.outcomes[2:]
    assert long_prompt.scheduled_s is not None and run.outcomes[0].completion_s == pytest.approx(10.0, abs=0.05)
    if bound_s is None:
        assert all(long_prompt.scheduled_s > (s.scheduled_s or 0) for s in shorts)
    else:
        assert all(long_prompt.scheduled_s < (s.scheduled_s or 0) for s in shorts)
    assert long_prompt.priority_score is not None  # the family's score at admission, as in the trace


def test_step_time_follows_the_model() -> None:
    from carbonforge_runtime.core.twin_data import step_time_s

    model = StepCostModel(name="m", version=1, gpu="g", tensor_parallel_size=1, floor_ms=10.0,
                          per_batched_token_ms=0.1, per_kv_token_read_ms=0.001, attention_ms=0.0001,
                          overhead_ms=1.0, kv_capacity_tokens=1000, provenance="p")
    assert step_time_s(model, 50, 0, 0) == pytest.approx((10.0 + 1.0) / 1000)
    assert step_time_s(model, 200, 1000, 100 * (50 + 50)) == pytest.approx((20.0 + 1.0 + 1.0 + 1.0) / 1000)


def delayed(base_ms: float, per_prompt_token_ms: float = 0.0) -> StepCostModel:
    return dataclasses.replace(FLAT, admission_base_ms=base_ms, admission_per_prompt_token_ms=per_prompt_token_ms)


def test_an_idle_engine_takes_a_request_in_exactly_the_admission_delay_after_its_arrival() -> None:
    # 7 ms of host time between the arrival stamp and the engine core: every time moves by 7 ms,
    # and latencies still count from the arrival stamp.
    plain = run_twin([SimRequest(0, 0.5, 16, 3)], settings(), FLAT).outcomes[0]
    late = run_twin([SimRequest(0, 0.5, 16, 3)], settings(), delayed(7.0)).outcomes[0]
    assert plain.scheduled_s == pytest.approx(0.5)
    assert late.arrival_s == 0.5 and late.scheduled_s == pytest.approx(0.5 + 0.007)
    assert late.first_token_s == pytest.approx(plain.first_token_s + 0.007)  # type: ignore[operator]
    assert late.completion_s == pytest.approx(plain.completion_s + 0.007)  # type: ignore[operator]
    # base + per prompt token: 2 ms + 0.01 ms x 300 tokens = 5 ms
    long = run_twin([SimRequest(0, 0.5, 300, 1)], settings(max_num_batched_tokens=512), delayed(2.0, 0.01))
    assert long.outcomes[0].scheduled_s == pytest.approx(0.505)


@pytest.mark.parametrize(("arrival_s", "enters_s"), [(0.015, 0.024), (0.0195, 0.024), (0.0205, 0.034)])
def test_a_busy_engine_takes_a_delayed_request_in_at_the_next_step_boundary(arrival_s: float, enters_s: float) -> None:
    # 4 ms of delay. A arrives at 0 and enters at 4 ms, then the engine is busy with it (a 40-token
    # prompt at 32 a step, then decoding): steps end at 14, 24, 34 ms... B is ready 4 ms after its
    # arrival and enters at the first step boundary after that.
    reqs = [SimRequest(0, 0.0, 40, 5), SimRequest(1, arrival_s, 8, 1)]
    run = run_twin(reqs, settings(), delayed(4.0))
    assert run.outcomes[0].scheduled_s == pytest.approx(0.004)
    assert run.outcomes[1].scheduled_s == pytest.approx(enters_s)


def test_a_per_token_delay_lets_a_short_prompt_enter_before_a_long_one_that_arrived_first() -> None:
    # L (400 tokens) arrives at 0 and is ready at 1 + 4 = 5 ms; S (10 tokens) arrives at 1 ms and is
    # ready at 2.1 ms: S enters first, on the idle engine, and L at the next boundary after 5 ms.
    reqs = [SimRequest(0, 0.0, 400, 1), SimRequest(1, 0.001, 10, 1)]
    run = run_twin(reqs, settings(max_num_batched_tokens=512), delayed(1.0, 0.01))
    long_prompt, short = run.outcomes
    assert (long_prompt.index, short.index) == (0, 1)
    assert short.scheduled_s == pytest.approx(0.0021)
    assert long_prompt.scheduled_s == pytest.approx(0.0021 + STEP)
    assert long_prompt.arrival_s == 0.0 and short.arrival_s == 0.001


def test_a_zero_delay_changes_nothing() -> None:
    reqs = [SimRequest(0, 0.0, 40, 2), SimRequest(1, 0.0, 40, 2), SimRequest(2, 0.025, 8, 1)]
    assert FLAT.has_admission_delay is False and delayed(0.0) == FLAT
    assert ([dataclasses.astuple(o) for o in run_twin(reqs, settings(), FLAT).outcomes]
            == [dataclasses.astuple(o) for o in run_twin(reqs, settings(), delayed(0.0)).outcomes])


def test_capacity_is_measured_without_the_admission_delay() -> None:
    from carbonforge_runtime.engine.twin import measure_capacity

    reqs = [SimRequest(i, i * 0.001, 16 + (i * 37) % 200, 4) for i in range(40)]
    s = settings(max_num_batched_tokens=256)
    assert measure_capacity(reqs, s, delayed(50.0, 0.5)) == measure_capacity(reqs, s, FLAT)
