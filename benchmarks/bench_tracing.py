#!/usr/bin/env python3
"""What request tracing costs: plain vLLM vs carbonforge-runtime at ``standard`` and at ``full``.

One run starts three engines on the built-in tiny CPU model with the same vLLM flags (the plain one
is the recipe's exact vLLM command minus ``--scheduler-cls``), one after the other, then sends the
same load to each in many short alternating rounds (the order rotates every round), so that drift
on a shared machine hits all three alike. Load: chat requests with mixed prompt and output lengths
(``ignore_eos`` fixes the output length), a fixed concurrency.

Ratios are paired within a round (each configuration against plain vLLM measured next to it) and
summarized by their median across rounds, which a burst of outside load in one round cannot move
much; pooled totals are printed too. Checks the targets (standard >= 0.99x plain throughput,
full >= 0.97x) and that every request was traced.

    .venv/bin/python benchmarks/bench_tracing.py --rounds 12 --requests 48 --concurrency 16

On a busy machine the end-to-end ratios carry the machine's noise. ``--loop`` measures the part
tracing adds, in-process and with little noise: vLLM's real scheduler is driven step by step with a
stand-in model (one sampled token per scheduled request, no forward pass), plain ``Scheduler``
against the CarbonForge scheduler at ``standard`` and at ``full`` (JSONL file), alternating; it
reports the CPU time added per request (engine loop and writer thread together) and relates it to
the CPU an actual engine spends per request on the same load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.harness import (  # noqa: E402
    TINY_KEY,
    EngineProcess,
    free_port,
    jsonl_records,
    median,
    other_vllm_servers,
    percentile,
    runtime,
    tiny_model_dir,
    tiny_served_name,
    tree_cpu_s,
)
from carbonforge_runtime.core.contract import CONTRACT_ENV, EngineContract, TraceConfig  # noqa: E402
from carbonforge_runtime.recipes import load_recipes, recipe_dirs, resolve  # noqa: E402
from carbonforge_runtime.runtime.planning.command import build_recipe_plan  # noqa: E402
from carbonforge_runtime.settings import load_settings  # noqa: E402

WORDS = ("invoice", "payment", "dashboard", "overdue", "receipt", "terms", "billing", "history", "account",
         "refund", "credit", "statement")
TARGETS = {"standard": 0.99, "full": 0.97}


@dataclass
class Engine:
    """One configuration under load: its process and what was measured on it."""

    process: EngineProcess
    trace: Path | None = None
    latencies_s: list[float] = field(default_factory=list)
    round_throughput: list[float] = field(default_factory=list)  # output tokens/s, one per round
    output_tokens: int = 0
    busy_s: float = 0.0
    cpu_s: float = 0.0  # CPU of the whole engine (every process) during the measured rounds
    requests: int = 0
    failures: int = 0

    @property
    def name(self) -> str:
        return self.process.name

    @property
    def port(self) -> int:
        return self.process.port


def engines(workdir: Path) -> list[Engine]:
    recipe = resolve(TINY_KEY, load_recipes(recipe_dirs(None)))
    model = str(tiny_model_dir())
    base_env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1", PYTHONUNBUFFERED="1")
    base_env.pop("CF_CONTEXT_KEY", None)
    port = free_port()
    plan = build_recipe_plan(recipe, load_settings({"CF_PORT": str(port), "CF_HOST": "127.0.0.1"}), [],
                             model_path=model, base_env=base_env)
    argv = list(plan.argv)
    index = argv.index("--scheduler-cls")
    del argv[index:index + 2]  # plain vLLM: the recipe's command without our scheduler
    env = dict(plan.env)  # the plan without its engine contract: vLLM as it comes
    out = [Engine(EngineProcess("plain vLLM", argv, env, workdir / "plain.log", port))]
    for level in ("standard", "full"):
        trace = workdir / f"{level}.jsonl"
        process = runtime(["--context-key", TINY_KEY, "--request-trace", level, "--trace-file", str(trace)],
                          workdir / level, name=f"runtime {level}")
        out.append(Engine(process, trace=trace))
    return out


def workload(round_no: int, count: int) -> list[tuple[str, int]]:
    """(user message, max_tokens) pairs: mixed prompt lengths (5-300 words) and outputs (8-128)."""
    rng = random.Random(1000 + round_no)
    items = []
    for i in range(count):
        words = rng.choice((5, 20, 60, 150, 300))
        text = f"round {round_no} request {i}: " + " ".join(rng.choice(WORDS) for _ in range(words))
        items.append((text, rng.choice((8, 16, 32, 64, 128))))
    return items


async def run_load(engine: Engine, items: list[tuple[str, int]], concurrency: int, served: str,
                   record: bool) -> None:
    import openai

    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{engine.port}/v1", api_key="unused", timeout=600,
                                max_retries=0)
    queue: asyncio.Queue[tuple[str, int]] = asyncio.Queue()
    for item in items:
        queue.put_nowait(item)
    latencies: list[float] = []
    tokens = 0
    failures = 0

    async def worker() -> None:
        nonlocal tokens, failures
        while True:
            try:
                text, max_tokens = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            started = time.perf_counter()
            try:
                reply = await client.chat.completions.create(
                    model=served, messages=[{"role": "user", "content": text}], max_tokens=max_tokens,
                    extra_body={"ignore_eos": True})
            except Exception:
                failures += 1
                continue
            latencies.append(time.perf_counter() - started)
            tokens += reply.usage.completion_tokens if reply.usage else 0

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    await client.close()
    if record:
        engine.round_throughput.append(tokens / elapsed)
        engine.latencies_s += latencies
        engine.output_tokens += tokens
        engine.busy_s += elapsed
        engine.requests += len(latencies)
        engine.failures += failures


def loop_cost(rounds: int, requests: int, engine_cpu_per_request_s: float | None) -> None:
    """The in-process measurement (see the module docstring)."""
    import torch
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    from carbonforge_runtime.engine.scheduler import make_scheduler

    model = str(tiny_model_dir())
    init_none_hash(sha256)
    hasher = get_request_block_hasher(16, sha256)
    workdir = Path(tempfile.mkdtemp(prefix="cf-bench-loop-"))

    def build(level: str | None) -> Any:
        config = VllmConfig(
            model_config=ModelConfig(model=model, tokenizer=model, dtype="bfloat16", seed=0, max_model_len=2048),
            scheduler_config=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=2048, max_model_len=2048,
                                             is_encoder_decoder=False),
            cache_config=CacheConfig(block_size=16, cache_dtype="auto", enable_prefix_caching=True),
            device_config=DeviceConfig("cpu"))
        config.cache_config.num_gpu_blocks = 4096
        kv = KVCacheConfig(num_blocks=4096, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(
            ["layer.0"], FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.bfloat16))])
        kwargs = dict(vllm_config=config, kv_cache_config=kv, structured_output_manager=StructuredOutputManager(config),
                      block_size=16, log_stats=False)
        if level is None:
            return Scheduler(**kwargs)
        trace = TraceConfig(level=level, file=str(workdir / f"{level}.jsonl"))
        os.environ[CONTRACT_ENV] = EngineContract(tracing=trace).to_json()
        try:
            return make_scheduler(**kwargs)
        finally:
            del os.environ[CONTRACT_ENV]

    rng = random.Random(7)
    shapes = [(rng.choice((20, 80, 240, 600)), rng.choice((8, 16, 32, 64, 128))) for _ in range(requests)]
    vocab = 2000

    def drive(scheduler: Any, round_no: int) -> tuple[float, float]:
        """(wall s, process CPU s) to serve the workload, 16 requests kept in the engine."""
        pending = list(enumerate(shapes))
        started_wall, started_cpu = time.perf_counter(), time.process_time()
        while pending or scheduler.has_requests():
            while pending and scheduler.get_num_unfinished_requests() < 32:
                i, (prompt, out) = pending.pop(0)
                ids = [(round_no * 7919 + i * 31 + k) % vocab + 10 for k in range(prompt)]
                scheduler.add_request(Request(f"chatcmpl-r{round_no}x{i}-{i:08x}", ids,
                                              SamplingParams(max_tokens=out, ignore_eos=True), None,
                                              arrival_time=time.time(), block_hasher=hasher))
            out_sched = scheduler.schedule()
            req_ids = list(out_sched.num_scheduled_tokens)
            scheduler.update_from_output(out_sched, ModelRunnerOutput(
                req_ids=req_ids, req_id_to_index={r: k for k, r in enumerate(req_ids)},
                sampled_token_ids=[[11] for _ in req_ids], logprobs=None, prompt_logprobs_dict={}, pooler_output=[]))
        writer = getattr(scheduler, "_cf_writer", None)
        while writer is not None and (writer.pending() or any(w.pending for w in writer.workers)):
            time.sleep(0.001)  # the writer thread's work belongs to this variant's CPU time
        return time.perf_counter() - started_wall, time.process_time() - started_cpu

    variants = {"plain vLLM": build(None), "standard": build("standard"), "full": build("full")}
    cpu: dict[str, list[float]] = {name: [] for name in variants}
    wall: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for round_no in range(rounds):
        shift = round_no % len(names)
        for name in names[shift:] + names[:shift]:
            w, c = drive(variants[name], round_no)
            wall[name].append(w)
            cpu[name].append(c)
    for name, scheduler in variants.items():
        if name != "plain vLLM":
            scheduler.shutdown()  # flush: the writer thread's work is counted above only while it ran
    base_cpu = median(cpu["plain vLLM"]) / requests
    print(f"\nengine-loop cost, in process: vLLM's scheduler driven with a stand-in model, {requests} requests "
          f"x {rounds} rounds per variant")
    print(f"{'variant':<12}{'loop+writer CPU per request':>30}{'added per request':>20}"
          f"{'share of engine CPU/request':>30}")
    for name in names:
        per_request = median(cpu[name]) / requests
        added = per_request - base_cpu
        share = "-" if engine_cpu_per_request_s is None or name == "plain vLLM" else \
            f"{100 * added / engine_cpu_per_request_s:.2f} %"
        print(f"{name:<12}{per_request * 1e6:>27.0f} us{added * 1e6:>17.0f} us{share:>30}")
    lines = {level: len(jsonl_records(workdir / f"{level}.jsonl")) for level in ("standard", "full")}
    print(f"records written: {lines} (expected {rounds * requests} each)")


def engine_cpu_per_request(engine: Engine) -> float | None:
    """CPU seconds the whole engine (API server, engine core, worker) spent per request (psutil)."""
    return engine.cpu_s / engine.requests if engine.requests and engine.cpu_s else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=12, help="alternating rounds (default 12)")
    parser.add_argument("--requests", type=int, default=48, help="requests per configuration per round")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--ready-timeout-s", type=float, default=600)
    parser.add_argument("--json", type=Path, help="also write the results here as JSON")
    parser.add_argument("--loop", action="store_true", help="also measure the engine-loop cost in process")
    parser.add_argument("--loop-only", action="store_true", help="only the in-process measurement")
    parser.add_argument("--loop-rounds", type=int, default=5)
    parser.add_argument("--loop-requests", type=int, default=400)
    args = parser.parse_args()
    if args.loop_only:
        loop_cost(args.loop_rounds, args.loop_requests, None)
        return 0
    if args.rounds * args.requests < 300:
        parser.error("measure at least 300 requests per configuration (--rounds x --requests)")

    served = tiny_served_name()
    workdir = Path(tempfile.mkdtemp(prefix="cf-bench-tracing-"))
    all_engines = engines(workdir)
    try:
        for engine in all_engines:  # one at a time: a start-up compiles, which would disturb the others
            print(f"starting {engine.name} ...", flush=True)
            engine.process.start().wait_ready(args.ready_timeout_s)
        for engine in all_engines:  # warm-up, not measured
            asyncio.run(run_load(engine, workload(-1, 2 * args.concurrency), args.concurrency, served, False))
        busy_rounds = 0
        for round_no in range(args.rounds):
            busy_rounds += other_vllm_servers(e.process.pid for e in all_engines) > 0
            items = workload(round_no, args.requests)
            shift = round_no % len(all_engines)
            order = all_engines[shift:] + all_engines[:shift]
            for engine in order:
                cpu_before = tree_cpu_s(engine.process.pid)
                asyncio.run(run_load(engine, items, args.concurrency, served, True))
                engine.cpu_s += tree_cpu_s(engine.process.pid) - cpu_before
            print(f"round {round_no + 1}/{args.rounds}: " + ", ".join(
                f"{e.name} {e.requests / e.busy_s:.1f} req/s" for e in all_engines), flush=True)
    finally:
        for engine in all_engines:
            if engine.process.proc is not None:
                engine.process.__exit__()

    plain = all_engines[0]
    rows = []
    for engine in all_engines:
        throughput = engine.output_tokens / engine.busy_s
        paired = [mine / base for mine, base in zip(engine.round_throughput, plain.round_throughput, strict=True)]
        rows.append({
            "config": engine.name,
            "requests": engine.requests,
            "failures": engine.failures,
            "req_per_s": engine.requests / engine.busy_s,
            "output_tok_per_s": throughput,
            "p50_s": median(engine.latencies_s),
            "p99_s": percentile(engine.latencies_s, 0.99),
            "throughput_ratio": median(paired),  # median of per-round paired ratios
            "pooled_throughput_ratio": throughput / (plain.output_tokens / plain.busy_s),
            "round_ratios": [round(r, 3) for r in paired],
            "p50_ratio": median(engine.latencies_s) / median(plain.latencies_s),
            "p99_ratio": percentile(engine.latencies_s, 0.99) / percentile(plain.latencies_s, 0.99),
            "records": None if engine.trace is None else len(jsonl_records(engine.trace)),
            "engine_cpu_ms_per_request": 1000 * engine.cpu_s / max(engine.requests, 1),
        })
    print()
    print(f"{args.rounds} alternating rounds x {args.requests} requests, concurrency {args.concurrency}, "
          f"model {served} (CPU)")
    header = f"{'config':<18}{'req':>6}{'req/s':>8}{'tok/s':>9}{'p50 s':>8}{'p99 s':>8}" \
             f"{'thr x':>8}{'pooled':>8}{'p50 x':>8}{'p99 x':>8}{'records':>9}"
    print(header)
    for row in rows:
        print(f"{row['config']:<18}{row['requests']:>6}{row['req_per_s']:>8.2f}{row['output_tok_per_s']:>9.0f}"
              f"{row['p50_s']:>8.3f}{row['p99_s']:>8.3f}{row['throughput_ratio']:>8.3f}"
              f"{row['pooled_throughput_ratio']:>8.3f}{row['p50_ratio']:>8.3f}{row['p99_ratio']:>8.3f}"
              f"{'-' if row['records'] is None else row['records']:>9}")
    print("thr x: median over rounds of the throughput ratio to plain vLLM in the same round; pooled: "
          "totals over all rounds")
    for row in rows[1:]:
        print(f"  {row['config']} per-round ratios: {row['round_ratios']}")
    if busy_rounds:
        print(f"caution: other vLLM engines were running on this machine in {busy_rounds} of {args.rounds} "
              "rounds; expect noise beyond the usual +/-10%")
    ok = True
    for row, engine in zip(rows[1:], all_engines[1:], strict=True):
        level = engine.name.split()[-1]
        target = TARGETS[level]
        # the warm-up requests are traced too
        traced = row["records"] == engine.requests + engine.failures + 2 * args.concurrency
        verdict = "meets" if row["throughput_ratio"] >= target else "MISSES"
        print(f"{level}: throughput {row['throughput_ratio']:.3f}x plain, {verdict} the {target}x target; "
              f"{'every request traced' if traced else 'RECORDS MISSING'}")
        ok = ok and traced
    if any(row["failures"] for row in rows):
        print("some requests failed: see the logs in", workdir)
        ok = False
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    print(f"logs and trace files: {workdir}")
    if args.loop:
        loop_cost(args.loop_rounds, args.loop_requests, engine_cpu_per_request(plain))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
