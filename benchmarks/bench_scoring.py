#!/usr/bin/env python
"""Scoring cost of every scheduling family: per request, and per engine step with many waiting.

Three measurements, each at ``--waiting`` requests (default 256):

1. ``score``: one ``family.score()`` call (pure arithmetic; the ltr/hybrid prediction included).
2. ``pick``: one admission decision as the pure policy makes it: every waiting request scored,
   then ``pick_next``.
3. ``queue``: the same decision inside the engine-side queue the shim installs
   (``ScoredQueue.peek_request`` + ``pop_request``) with real vLLM ``Request`` objects and a real
   vLLM ``KVCacheManager`` holding shared prefixes, so families that read the prefix cache pay
   for their lookups (up to the family's ``cache_lookup_limit``).

The per-step overhead is the ``queue`` cost times the admissions per step (``--admissions``).
It is printed as a share of a decode step: the tiny CPU engine's, measured here on the real
engine with ``--engine``, and ``--step-ms`` (default 25 ms: a decode step of a ~30B model at
batch 32-64 on one H100/A100-class GPU, the deployments the shipped recipes target).

    .venv/bin/python benchmarks/bench_scoring.py [--engine]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from carbonforge_runtime.core.ordering.base import WaitingRequest  # noqa: E402
from carbonforge_runtime.core.ordering.ltr import LtrModel, prefix_hash  # noqa: E402
from carbonforge_runtime.core.ordering.registry import make_family, pick_next  # noqa: E402

FAMILIES = ("fcfs", "ltr-promptlen", "affinity", "ltr", "hybrid", "oracle")
BLOCK = 16


def best_of(fn: Callable[[], None], repeats: int, inner: int) -> float:
    """Seconds per call: the best of ``repeats`` timings of ``inner`` calls (least disturbed by others)."""
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - started) / inner)
    return best


def workload(n: int, seed: int) -> list[dict[str, Any]]:
    """``n`` waiting requests: prompts of 30 templates (shared 256-token prefixes) or unique ones."""
    rng = random.Random(seed)
    templates = [[rng.randrange(100, 4000) for _ in range(256)] for _ in range(30)]
    now = time.time()
    out = []
    for i in range(n):
        size = min(4000, max(20, int(rng.lognormvariate(6.5, 0.8))))
        if rng.random() < 0.7:
            ids = templates[rng.randrange(30)] + [rng.randrange(100, 4000) for _ in range(max(1, size - 256))]
        else:
            ids = [rng.randrange(100, 4000) for _ in range(size)]
        out.append({"id": f"cmpl-{i:04x}", "ids": ids, "arrival": now - rng.uniform(0, 30), "max_tokens": 512,
                    "true_out": rng.randint(1, 800)})
    return out


def trained_model(path: Path) -> str:
    model = LtrModel()
    rng = random.Random(7)
    for _ in range(5000):
        key = rng.randrange(200)
        model.observe(key, rng.randint(20, 4000), rng.randint(1, 800))
    model.save(path)
    return str(path)


def family_params(name: str, model_path: str) -> dict[str, Any]:
    if name in ("ltr", "hybrid"):
        return {"model": model_path}
    return {}


def pure_costs(reqs: list[dict[str, Any]], model_path: str) -> dict[str, tuple[float, float]]:
    waiting = [WaitingRequest(r["id"], r["arrival"], len(r["ids"]), 128, r["max_tokens"], prefix_hash(r["ids"]), 0,
                              r["true_out"]) for r in reqs]
    out = {}
    for name in FAMILIES:
        family = make_family(name, family_params(name, model_path))
        bound = getattr(family, "max_overtake_s", None)
        now = time.time()
        one = waiting[len(waiting) // 2]
        per_score = best_of(lambda f=family, r=one, t=now: f.score(r, t), 5, 20_000)  # type: ignore[misc]

        def decide(f: Any = family, b: Any = bound, t: float = now) -> None:
            scores = [f.score(r, t) for r in waiting]
            pick_next(waiting, [-1e300 if s is None else s for s in scores], t, b)

        out[name] = (per_score, best_of(decide, 5, 50))
    return out


def queue_costs(reqs: list[dict[str, Any]], model_path: str, tenants: int = 1) -> dict[str, float]:
    """Seconds per admission (peek + pop) in the shim's ScoredQueue with a real KV cache manager, its
    tenant ledger as the engine builds it, and the requests spread over ``tenants`` tenants (with more
    than one, fcfs's queue is the scored queue too, and the counters decide between tenants)."""
    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.request import Request

    from carbonforge_runtime.core.ordering.tenancy import Ledger
    from carbonforge_runtime.engine.scheduler import ScoredQueue, _Live

    init_none_hash(sha256)
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    config = KVCacheConfig(num_blocks=100_000, kv_cache_tensors=[],
                           kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)])
    manager = KVCacheManager(config, max_model_len=8192, scheduler_block_size=BLOCK, hash_block_size=BLOCK,
                             enable_caching=True)
    hasher = get_request_block_hasher(BLOCK, sha256)

    def request(r: dict[str, Any], suffix: str = "") -> Any:
        extra: dict[str, Any] = {"cf_true_output_tokens": r["true_out"]}
        if tenants > 1:
            extra["cf_tenant"] = f"tenant-{int(r['id'][5:], 16) % tenants}"
        return Request(r["id"] + suffix, list(r["ids"]), SamplingParams(max_tokens=r["max_tokens"], extra_args=extra),
                       None, arrival_time=r["arrival"], block_hasher=hasher)

    # Fill the prefix cache with every template (allocate, compute, free).
    for r in reqs[:60]:
        warm = request(r, "-warm")
        blocks = manager.get_computed_blocks(warm)[0]
        manager.allocate_slots(warm, warm.num_tokens, 0, blocks)
        warm.num_computed_tokens = warm.num_tokens
        manager.free(warm)

    def cached_tokens(req: Any) -> int:
        if req.num_computed_tokens:
            return int(req.num_computed_tokens)
        return int(manager.get_computed_blocks(req)[1])

    out = {}
    for name in FAMILIES:
        family = make_family(name, family_params(name, model_path))
        if not family.reorders and tenants == 1:
            out[name] = 0.0
            continue
        live: dict[str, Any] = {}
        queue = ScoredQueue(family, live, cached_tokens, ledger=Ledger())
        pool = [request(r) for r in reqs]
        for req in pool:
            live[req.request_id] = _Live(req)
            queue.add_request(req)

        def admit(q: Any = queue) -> None:
            chosen = q.peek_request()
            q.pop_request()
            q.add_request(chosen)  # keep the queue at the same length

        out[name] = best_of(admit, 5, 20)
    return out


def engine_step_ms() -> float:
    """The tiny CPU engine's decode step, measured: one long request, time per output token."""
    import openai

    from benchmarks.harness import TINY_KEY, runtime, tiny_served_name

    log_dir = Path("/tmp") / f"bench-scoring-{time.time_ns()}"
    served = tiny_served_name()
    with runtime(["--context-key", TINY_KEY], log_dir) as engine:
        client = openai.OpenAI(base_url=engine.base_url, api_key="unused", max_retries=0, timeout=300)
        client.completions.create(model=served, prompt=[100, 200, 300], max_tokens=16,
                                  extra_body={"ignore_eos": True})
        times = []
        for _ in range(3):
            started = time.perf_counter()
            client.completions.create(model=served, prompt=[100, 200, 300], max_tokens=1000,
                                      extra_body={"ignore_eos": True})
            times.append((time.perf_counter() - started) / 1000)
        return min(times) * 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--waiting", type=int, default=256)
    parser.add_argument("--admissions", type=int, default=1, help="admissions per engine step")
    parser.add_argument("--step-ms", type=float, default=25.0, help="reference decode step of a GPU deployment")
    parser.add_argument("--engine", action="store_true", help="also measure the tiny CPU engine's decode step")
    parser.add_argument("--tenants", type=int, default=1, help="spread the waiting requests over this many tenants")
    args = parser.parse_args()
    reqs = workload(args.waiting, seed=1)
    model_path = trained_model(Path("/tmp") / "bench-scoring-ltr.json")
    pure = pure_costs(reqs, model_path)
    queue = queue_costs(reqs, model_path, args.tenants)
    steps = {f"{args.step_ms:g} ms reference": args.step_ms}
    if args.engine:
        steps["tiny CPU engine"] = engine_step_ms()
    print(f"{args.waiting} waiting requests of {args.tenants} tenant(s), {args.admissions} admission(s) per step")
    header = f"{'family':14s} {'score/req':>10s} {'pick (pure)':>12s} {'queue peek+pop':>15s}"
    for label in steps:
        header += f"  {'% of ' + label:>24s}"
    print(header)
    for name in FAMILIES:
        per_score, pick = pure[name]
        per_step_ms = queue[name] * args.admissions * 1000
        line = f"{name:14s} {per_score * 1e6:8.2f}us {pick * 1e6:10.1f}us {queue[name] * 1e6:13.1f}us"
        for step in steps.values():
            line += f"  {100 * per_step_ms / step:23.2f}%"
        print(line)
    for label, step in steps.items():
        print(f"step: {label} = {step:.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
