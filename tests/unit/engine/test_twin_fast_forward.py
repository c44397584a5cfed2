"""The twin's fast-forward of plain decode steps changes nothing: the same traces run with it on
and off give identical outcomes (times as exact floats), step counts, token totals and samples.

Random traces with fixed seeds, at high load with a small KV cache (so vLLM preempts), with shared
prompt blocks (so vLLM's prefix cache hits), under synchronous and asynchronous scheduling, with
chunked prefill on and off, and under three ordering families.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import astuple

import pytest

pytest.importorskip("vllm")

from carbonforge_runtime.core.twin_data import SimRequest, StepCostModel, TwinRun, TwinSettings
from carbonforge_runtime.engine.twin import run_twin

# Coefficients that are not round numbers, so any change in the order of float additions shows.
COST = StepCostModel(name="test", version=1, gpu="test", tensor_parallel_size=1, floor_ms=11.3,
                     per_batched_token_ms=0.0137, per_kv_token_read_ms=0.000731, attention_ms=1.3e-6,
                     overhead_ms=0.77, kv_capacity_tokens=6000, provenance="test")


def azure_like(seed: int, count: int, rate: float) -> list[SimRequest]:
    """Poisson arrivals, long-tailed prompt and output lengths, nothing shared."""
    rng = random.Random(seed)
    now, out = 0.0, []
    for i in range(count):
        now += rng.expovariate(rate)
        prompt = max(1, min(900, int(rng.lognormvariate(5.0, 0.9))))
        output = max(1, min(300, int(rng.lognormvariate(3.6, 1.0))))
        out.append(SimRequest(i, now, prompt, output))
    return out


def mooncake_like(seed: int, count: int, rate: float, block: int = 16) -> list[SimRequest]:
    """Prompts built from a small pool of shared prefixes, Mooncake-style hash ids."""
    rng = random.Random(seed)
    prefixes = [tuple(rng.randrange(1 << 20) for _ in range(rng.randint(2, 12))) for _ in range(6)]
    now, out = 0.0, []
    for i in range(count):
        now += rng.expovariate(rate)
        shared = rng.choice(prefixes)[:rng.randint(1, 12)]
        own = tuple(rng.randrange(1 << 20, 1 << 30) for _ in range(rng.randint(0, 6)))
        ids = shared + own
        prompt = max(1, len(ids) * block - rng.randrange(block))
        output = max(1, min(250, int(rng.lognormvariate(3.4, 1.0))))
        out.append(SimRequest(i, now, prompt, output, ids, block))
    return out


def settings(**changes: object) -> TwinSettings:
    base: dict[str, object] = dict(family="fcfs", params={}, max_num_seqs=24, max_num_batched_tokens=512,
                                   max_model_len=2048, kv_tokens=2400, async_scheduling=True,
                                   sample_every_s=0.05)
    base.update(changes)
    return TwinSettings(**base)  # type: ignore[arg-type]


def assert_same(fast: TwinRun, plain: TwinRun) -> None:
    assert [astuple(o) for o in fast.outcomes] == [astuple(o) for o in plain.outcomes]
    assert (fast.steps, fast.makespan_s, fast.busy_s, fast.prefill_tokens, fast.decode_tokens) == (
        plain.steps, plain.makespan_s, plain.busy_s, plain.prefill_tokens, plain.decode_tokens)
    assert fast.samples == plain.samples


WHOLE_PROMPTS = {"max_num_batched_tokens": 2048}  # without chunking a step must hold a whole prompt
CASES = [
    # (name, trace, settings changes)
    ("azure-async", azure_like(1, 300, 6.0), {}),
    ("azure-sync", azure_like(2, 300, 6.0), {"async_scheduling": False}),
    ("azure-no-chunking", azure_like(3, 250, 6.0), {"enable_chunked_prefill": False, **WHOLE_PROMPTS}),
    ("azure-no-chunking-sync", azure_like(4, 250, 6.0), {"enable_chunked_prefill": False, "async_scheduling": False,
                                                          **WHOLE_PROMPTS}),
    ("azure-light-load", azure_like(5, 200, 1.5), {"kv_tokens": 20_000}),
    ("mooncake-async", mooncake_like(6, 300, 6.0), {"kv_tokens": 1200}),
    ("mooncake-sync", mooncake_like(7, 300, 6.0), {"async_scheduling": False, "kv_tokens": 1200}),
    ("mooncake-ltr-promptlen", mooncake_like(8, 250, 6.0), {"family": "ltr-promptlen"}),
    ("azure-oracle-sync", azure_like(9, 250, 6.0), {"family": "oracle", "async_scheduling": False}),
    ("mooncake-block-32", mooncake_like(10, 250, 5.0, block=32), {"block_size": 32, "kv_tokens": 3200}),
]


@pytest.mark.parametrize(("name", "trace", "changes"), CASES, ids=[c[0] for c in CASES])
def test_fast_forward_gives_the_plain_loops_results(name: str, trace: list[SimRequest],
                                                    changes: dict[str, object]) -> None:
    s = settings(**changes)
    plain = run_twin(trace, s, COST, fast_forward=False)
    fast = run_twin(trace, s, COST)
    assert_same(fast, plain)
    # The cases exercise what they are meant to: everything completes, vLLM preempts under the
    # small KV caches and its prefix cache hits on the shared prompt blocks.
    assert all(o.finish_reason == "length" for o in plain.outcomes)
    if (name.startswith("azure") and "light" not in name) or name in ("mooncake-async", "mooncake-sync"):
        assert sum(o.preemptions for o in plain.outcomes) > 0
    if name.startswith("mooncake"):
        assert sum(o.cached_prompt_tokens or 0 for o in plain.outcomes) > 0


def test_fast_forward_skips_steps() -> None:
    """The stretches are found: with fast-forward the scheduler runs far fewer steps itself."""
    import carbonforge_runtime.engine.twin as twin

    trace = azure_like(11, 150, 3.0)
    calls = {True: 0, False: 0}
    build = twin.build_scheduler

    def counting(s: TwinSettings):  # type: ignore[no-untyped-def]
        scheduler, hasher = build(s)
        schedule = scheduler.schedule

        def wrapped(*args, **kwargs):  # type: ignore[no-untyped-def]
            calls[mode] += 1
            return schedule(*args, **kwargs)

        scheduler.schedule = wrapped
        return scheduler, hasher

    twin.build_scheduler = counting
    try:
        runs = {}
        for mode in (False, True):
            runs[mode] = run_twin(trace, settings(kv_tokens=20_000), COST, fast_forward=mode)
    finally:
        twin.build_scheduler = build
    assert_same(runs[True], runs[False])
    assert calls[False] == runs[False].steps
    assert calls[True] < calls[False] / 2


@pytest.mark.parametrize("asynchronous", [False, True])
def test_fast_forward_gives_the_plain_loops_results_with_an_admission_delay(asynchronous: bool) -> None:
    """Requests enter after the host's admission delay (base and per prompt token, so the order in
    which they enter differs from their arrival order): the fast-forward still changes nothing."""
    cost = dataclasses.replace(COST, admission_base_ms=3.1, admission_per_prompt_token_ms=0.057)
    trace = azure_like(12, 250, 6.0)
    s = settings(async_scheduling=asynchronous)
    plain = run_twin(trace, s, cost, fast_forward=False)
    assert_same(run_twin(trace, s, cost), plain)
    without = run_twin(trace, s, COST)
    assert [o.arrival_s for o in plain.outcomes] == [r.arrival_s for r in trace]
    assert sum(o.scheduled_s or 0 for o in plain.outcomes) > sum(o.scheduled_s or 0 for o in without.outcomes)
