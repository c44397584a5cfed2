#!/usr/bin/env python3
"""Benchmark the twin: the whole Azure conversation trace (19,366 requests) through ``sim``'s loop,
one family, on one core. Prints steps per second, requests per second and the wall and CPU time
(the target is under 60 s), with the time to load the trace and build the scheduler apart.
``--plain`` turns the twin's fast-forward of plain decode steps off (the step-by-step loop; the
results are the same).

    PYTHONHASHSEED=0 taskset -c 0 .venv/bin/python benchmarks/bench_sim.py \\
        [--trace PATH] [--context-key KEY] [--family NAME] [--limit N] [--sync] [--plain] [--profile]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

DEFAULT_TRACE = REPO.parent / "shared" / "data" / "azure-llm-2023" / "AzureLLMInferenceTrace_conv.csv"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--context-key", default="qwen3-32b:fp8:chat:a100-80x1")
    parser.add_argument("--family", default="fcfs")
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--rate", type=float, default=1.0)
    parser.add_argument("--sync", action="store_true", help="Synchronous scheduling (no step in flight).")
    parser.add_argument("--plain", action="store_true", help="Step by step: no fast-forward of decode steps.")
    parser.add_argument("--profile", action="store_true", help="Print the top of a cProfile of the loop.")
    args = parser.parse_args()
    if os.environ.get("PYTHONHASHSEED") != "0":
        print("note: PYTHONHASHSEED is not 0; figures are fine, results are not reproducible", file=sys.stderr)

    t0 = time.perf_counter()
    from carbonforge_runtime.core.step_models import resolve_model
    from carbonforge_runtime.core.twin_data import TwinSettings
    from carbonforge_runtime.engine.twin import run_twin
    from carbonforge_runtime.offline.sim.inputs import WindowOptions, load_trace, window
    from carbonforge_runtime.recipes import load_recipes, recipe_dirs, resolve

    recipe = resolve(args.context_key, load_recipes(recipe_dirs(None)))
    knobs = recipe.vllm
    cost = resolve_model(None, recipe.key.hardware.family, int(knobs.get("tensor_parallel_size", 1)))
    t_import = time.perf_counter() - t0
    t0 = time.perf_counter()
    requests = window(load_trace(args.trace), WindowOptions(limit=args.limit, rate=args.rate))
    t_load = time.perf_counter() - t0
    settings = TwinSettings(family=args.family, params={}, max_num_seqs=int(knobs["max_num_seqs"]),
                            max_num_batched_tokens=int(knobs["max_num_batched_tokens"]),
                            max_model_len=int(knobs["max_model_len"]), kv_tokens=cost.kv_capacity_tokens,
                            async_scheduling=not args.sync)
    t0 = time.perf_counter()
    cpu0 = time.process_time()
    if args.profile:
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        run = profiler.runcall(run_twin, requests, settings, cost, fast_forward=not args.plain)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    else:
        run = run_twin(requests, settings, cost, fast_forward=not args.plain)
    t_run = time.perf_counter() - t0
    cpu_run = time.process_time() - cpu0
    done = sum(1 for o in run.outcomes if o.completion_s is not None)
    print(f"trace            {args.trace.name}: {len(requests)} requests, family {args.family}, "
          f"{args.context_key}, cost model {cost.name}, {'sync' if args.sync else 'async'} scheduling"
          f"{', step by step' if args.plain else ''}")
    print(f"import           {t_import:.1f} s (vLLM and the package)")
    print(f"load trace       {t_load:.2f} s")
    print(f"simulate         {t_run:.1f} s wall, {cpu_run:.1f} s CPU (scheduler built inside)")
    print(f"steps            {run.steps} ({run.steps / t_run:.0f} steps/s)")
    request_steps = run.decode_tokens + run.steps
    print(f"request-steps    about {request_steps} ({t_run / request_steps * 1e6:.1f} us each)")
    print(f"requests         {done} completed ({done / t_run:.0f} requests/s)")
    print(f"virtual time     {run.makespan_s:.0f} s")
    print(f"total            {t_load + t_run:.1f} s (target < 60 s on one core, import excluded)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
