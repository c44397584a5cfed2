#!/usr/bin/env python
"""Ordering benchmark: every scheduling family on the real CPU engine, side by side with FCFS.

The tiny CPU recipe is served with two running sequences (``max_num_seqs`` 2), so that a queue
forms under load, and the same traces are replayed at the same loads:

* ``conv``      -- windows of the Azure conversation trace (token counts scaled down); the work
  is decoding, so the order that matters is by output length;
* ``prefill``   -- the same arrivals with long prompts and short outputs (code-like traffic). The
  engine's token budget per step is small (64), so prefill time grows with the prompt, as it
  does on a GPU with a large model (the tiny model alone would prefill any prompt in one step);
* ``templated`` -- a generated workload of six applications, each with its own system prompt
  (shared prefix) and output-length distribution, served with a prefix cache that holds only a
  few of the six system prompts besides the running requests.

Capacity is measured first, per window: the completion rate of FCFS on an all-at-once burst of
the window (the engine never idles). The runs then replay each window at 60% and 90% of it. Every
metric comes from the runtime's own trace of the replay (server-side arrival to completion) and is
printed as a ratio to FCFS on the same trace, seed and load (the mean over seeds, with the
spread); the prefix-cache hit rate as the difference in points. ``fcfs-again`` replays FCFS a
second time: its row is the noise floor of the measurement (run-to-run jitter of the engine).

Two modes. ``--mode sessions`` serves the recipe once per family, in turn. On a shared machine
the engine's speed drifts by tens of percent between sessions minutes apart, which swamps the
differences being measured; so the default ``--mode switch`` serves one engine per workload whose
recipe names a benchmark-only family (``benchmarks/bench_switch/sitecustomize.py``) that delegates to
the family named in a control file, and the families take turns run by run.

    .venv/bin/python benchmarks/bench_ordering.py --out /work/bench-out/ordering

About an hour with the defaults on 2 cores; run it on a quiet machine. ``--quick`` runs one seed
of fcfs and oracle; ``--ltr-check-only`` fits the ranker on the runtime's own full-level trace of
the templated replays and reports its Kendall tau on a held-out seed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.harness import (  # noqa: E402
    EngineProcess,
    TraceTail,
    percentile,
    pin_processes,
    runtime,
    tiny_model_dir,
    tiny_served_name,
)
from carbonforge_runtime.offline.replay.plan import PlanOptions, build_plan  # noqa: E402
from carbonforge_runtime.offline.replay.runner import RunOptions, run_replay  # noqa: E402
from carbonforge_runtime.offline.replay.trace import load_recording, write_jsonl  # noqa: E402
from carbonforge_runtime.offline.replay.workloads import prefill_heavy, templated, tokenizer_counter, window  # noqa: E402

AZURE = Path("/work/shared/data/azure-llm-2023/AzureLLMInferenceTrace_conv.csv")
FAMILY_ORDER = ("fcfs", "ltr-promptlen", "affinity", "ltr", "hybrid", "oracle", "fcfs-again")
#: Bench labels that run another family (the A/A row: the noise floor).
RUNS_AS = {"fcfs-again": "fcfs"}
SWITCH = "bench-switch"
SWITCH_DIR = REPO / "benchmarks" / "bench_switch"
WORKLOADS = ("conv", "prefill", "templated")
LOADS: tuple[float, ...] = (0.6, 0.9)

#: Bench parameters of each family. The replay forces each output length with max_tokens, so the
#: learned families must not read max_tokens (use_max_tokens: false) or they would see the answer.
PARAMS: dict[str, dict[str, Any]] = {
    "fcfs": {},
    "ltr-promptlen": {"aging_rate": 400.0, "cache_lookup_limit": 128},
    "affinity": {"aging_rate": 200.0},
    "ltr": {"aging_rate": 20.0, "use_max_tokens": False},
    "hybrid": {"aging_rate": 20.0, "use_max_tokens": False, "cache_weight": 0.02, "cache_lookup_limit": 128},
    "oracle": {"aging_rate": 20.0},
}
#: Token scaling per workload, so prompt + output fit the tiny model's 2048-token context.
PLAN: dict[str, dict[str, Any]] = {
    "conv": {"token_scale": 0.3, "max_prompt_tokens": 1700, "max_output_tokens": 300},
    "prefill": {"token_scale": 0.4, "max_prompt_tokens": 1900, "max_output_tokens": 16},
    "templated": {"token_scale": 1.0},
}


@dataclass(frozen=True)
class Engine:
    """The serving knobs of one workload's engine."""

    max_num_seqs: int = 2
    max_num_batched_tokens: int = 2048
    kv_blocks: int = 256
    block_size: int = 32  # the CPU attention backend needs a multiple of 32
    max_model_len: int = 2048


ENGINES: dict[str, Engine] = {
    "conv": Engine(),
    # Prefill in 64-token chunks: a prompt's prefill takes steps in proportion to its length.
    "prefill": Engine(max_num_batched_tokens=64),
    # 60 blocks of 32 tokens: the two running requests plus one or two of the six system prompts
    # (its longest request is about 1,600 tokens).
    "templated": Engine(kv_blocks=60, max_model_len=1792),
}


#: CPUs the engine's worker computes on (VLLM_CPU_OMP_THREADS_BIND), set by ``pin_processes`` in
#: ``harness.py``: the worker gets the first CPU to itself, everything else keeps to the others.
WORKER_CPUS: str | None = None


def bench_recipe(family: str, engine: Engine, params: dict[str, Any] | None = None) -> str:
    bind = f', VLLM_CPU_OMP_THREADS_BIND: "{WORKER_CPUS}"' if WORKER_CPUS else ""
    return f"""key: cf-tiny-bench-{family}:bf16:chat:cpu
plan: free
description: ordering benchmark ({family}); few running sequences and a small KV cache so that order matters
model: {{repo: carbonforge/tiny-chat, served_name: {tiny_served_name()}, builtin: tiny-chat}}
vllm:
  dtype: bfloat16
  max_model_len: {engine.max_model_len}
  max_num_seqs: {engine.max_num_seqs}
  max_num_batched_tokens: {engine.max_num_batched_tokens}
  enable_prefix_caching: true
  block_size: {engine.block_size}
  extra_args: ["--num-gpu-blocks-override", "{engine.kv_blocks}"]
drain_timeout_s: 5
env: {{VLLM_CPU_KVCACHE_SPACE: "1", HF_HUB_OFFLINE: "1", VLLM_SERVER_DEV_MODE: "1"{bind}}}
scheduler: {{family: {family}, params: {json.dumps(family_params(family, engine) if params is None else params)}}}
"""


def family_params(family: str, engine: Engine) -> dict[str, Any]:
    """PARAMS of ``family`` on ``engine``. The oracle knows the true cost of a request in engine steps:
    one per output token plus 1/max_num_batched_tokens per prompt token; hybrid weighs prompts alike."""
    params = dict(PARAMS[RUNS_AS.get(family, family)])
    if family in ("oracle", "hybrid"):
        params["prompt_weight"] = 1.0 / engine.max_num_batched_tokens
    return params


# -- workloads ----------------------------------------------------------------------------------------


def make_workloads(out: Path, seeds: list[int], n: int, ltr_train: int) -> dict[tuple[str, int], Path]:
    """One JSONL file per (workload, seed), plus the training trace of the offline ltr model."""
    recording = load_recording(AZURE)
    count = tokenizer_counter(str(tiny_model_dir()))
    files: dict[tuple[str, int], Path] = {}
    for seed in seeds:
        # Windows spread over the hour of the trace; each seed its own.
        start = 1500 + (seed * 5000) % (len(recording.requests) - n - 1500)
        conv = window(recording, start, n)
        files["conv", seed] = out / f"conv-s{seed}.jsonl"
        write_jsonl(files["conv", seed], conv)
        files["prefill", seed] = out / f"prefill-s{seed}.jsonl"
        write_jsonl(files["prefill", seed],
                    prefill_heavy(load_recording(files["conv", seed]), prompt_factor=2.0, output_divisor=16.0))
        files["templated", seed] = out / f"templated-s{seed}.jsonl"
        write_jsonl(files["templated", seed], templated(n, seed=seed, rate=10.0, count_tokens=count))
    train = out / "templated-train.jsonl"
    write_jsonl(train, templated(ltr_train, seed=1000, rate=10.0, count_tokens=count))
    files["train", 0] = train
    return files


def recorded_rate(path: Path) -> float:
    reqs = load_recording(path).requests
    return (len(reqs) - 1) / reqs[-1].arrival_s


# -- one engine session ------------------------------------------------------------------------------


class Session:
    def __init__(self, family: str, out: Path, engine: Engine, level: str = "standard",
                 name: str | None = None) -> None:
        self.family = family
        self.dir = out / (name or f"session-{family}")
        self.dir.mkdir(parents=True, exist_ok=True)
        recipes = self.dir / "recipes"
        recipes.mkdir(exist_ok=True)
        env = {"CF_RECIPES_DIR": str(recipes)}
        params = None
        self.control = self.dir / "active-family.json"
        if family == SWITCH:
            # One engine for every family: the bench-only family in benchmarks/bench_switch delegates to
            # the family named in the control file.
            params = {"control": str(self.control),
                      "families": {f: family_params(f, engine) for f in FAMILY_ORDER if f not in RUNS_AS}}
            self.control.write_text(json.dumps({"family": "fcfs"}))
            env["CF_BENCH_SWITCH"] = "1"
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SWITCH_DIR), os.environ.get("PYTHONPATH", "")) if p)
        (recipes / "bench.yaml").write_text(bench_recipe(family, engine, params))
        self.trace = self.dir / "trace.jsonl"
        self.trace.unlink(missing_ok=True)
        self.runtime: EngineProcess = runtime(
            ["--context-key", f"cf-tiny-bench-{family}:bf16:chat:cpu", "--request-trace", level,
             "--trace-file", str(self.trace)],
            self.dir / "logs", env=env,
        )
        self.tail = TraceTail(self.trace)

    def __enter__(self) -> Session:
        self.runtime.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.runtime.__exit__(*exc)

    def activate(self, family: str) -> None:
        """Switch the bench-switch family (takes effect within 0.1 s, before the next run starts)."""
        self.control.write_text(json.dumps({"family": family}))
        time.sleep(0.5)

    def reset_prefix_cache(self) -> None:
        url = self.runtime.base_url.removesuffix("/v1") + "/reset_prefix_cache"
        with urllib.request.urlopen(urllib.request.Request(url, method="POST"), timeout=30) as resp:
            assert resp.status == 200

    def records(self, ids: set[str], timeout_s: float = 60.0) -> list[dict[str, Any]]:
        return self.tail.wait(ids, timeout_s)

    def replay(self, path: Path, workload: str, rate: float, seed: int,
               limit: int | None = None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        plan = build_plan(load_recording(path), PlanOptions(rate=rate, seed=seed, limit=limit, **PLAN[workload]))
        self.reset_prefix_cache()
        options = RunOptions(base_url=self.runtime.base_url, model=tiny_served_name(), concurrency=1024,
                             deadline_s=900, send_true_length=True, progress_every_s=1e9)
        result = asyncio.run(run_replay(plan, options))
        summary = result.summary()
        for error in sorted({o.error for o in result.outcomes if o.error}):
            print(f"  warning: a request failed: {error}", file=sys.stderr, flush=True)
        ids = {o.request_id for o in result.outcomes if o.request_id}
        return self.records(ids), summary


def measure_capacity(session: Session, path: Path, workload: str, seed: int) -> float:
    """FCFS's completion rate (req/s) on an all-at-once burst of the window: the engine never idles
    and its running slots stay full, so this is the arrival rate at which FCFS saturates (mean of
    two bursts). Each window has its own (its mix of long and short requests differs)."""
    rates = []
    for _ in range(2):
        records, _ = session.replay(path, workload, rate=1e6, seed=seed)
        span = max(r["t_completion"] for r in records) - min(r["t_arrival"] for r in records)
        rates.append(len(records) / span)
    print(f"  {workload}/{seed}: FCFS capacity {statistics.fmean(rates):.2f} req/s "
          f"(bursts: {', '.join(f'{r:.2f}' for r in rates)})", flush=True)
    return statistics.fmean(rates)


# -- metrics -----------------------------------------------------------------------------------------


def metrics(records: list[dict[str, Any]]) -> dict[str, float]:
    e2e = [r["e2e_latency_s"] for r in records]
    per_token = [r["e2e_latency_s"] / r["output_tokens"] for r in records if r["output_tokens"]]
    prompt = sum(r["prompt_tokens"] for r in records)
    cached = sum(r.get("cached_prompt_tokens") or 0 for r in records)
    return {
        "n": float(len(records)),
        "mean": statistics.fmean(e2e),
        "p50": percentile(e2e, 0.50),
        "p99": percentile(e2e, 0.99),
        "max": max(e2e),
        "wait": statistics.fmean(r["queue_wait_s"] for r in records),
        "per_tok": statistics.fmean(per_token),
        "hit": 100.0 * cached / prompt if prompt else 0.0,
    }


COLUMNS = ("mean", "p50", "p99", "max", "wait", "per_tok", "hit")
HEADERS = {"mean": "mean e2e", "p50": "p50", "p99": "p99", "max": "max", "wait": "queue wait",
           "per_tok": "lat/out tok", "hit": "cache hit"}


def baseline(results: dict[str, Any], family: str, workload: str, load: float, seed: int) -> dict[str, float] | None:
    """What ``family`` is compared with: the mean of the two FCFS runs of the same trace, seed and load
    (``fcfs`` and ``fcfs-again``, a steadier estimate than either); ``fcfs-again`` itself against
    ``fcfs`` alone (the A/A comparison)."""
    first = results.get(f"fcfs/{workload}/{load}/{seed}")
    again = results.get(f"fcfs-again/{workload}/{load}/{seed}")
    if first is None or family in RUNS_AS or again is None:
        return first
    return {c: (first[c] + again[c]) / 2 for c in COLUMNS}


def tables(results: dict[str, Any], families: list[str], seeds: list[int]) -> str:
    """One table per load: rows workload x family, each cell the ratio to FCFS (mean [min..max] over seeds)."""
    out = []
    for load in LOADS:
        out.append(f"\n### Load {load:.0%} of FCFS capacity\n")
        out.append("| workload | family | " + " | ".join(HEADERS[c] for c in COLUMNS) + " |")
        out.append("|---|---|" + "---|" * len(COLUMNS))
        for workload in WORKLOADS:
            base_runs = [results.get(f"fcfs/{workload}/{load}/{s}") for s in seeds]
            if not all(base_runs):
                continue
            cells = []
            for c in COLUMNS:
                value = statistics.fmean(r[c] for r in base_runs)  # type: ignore[index]
                cells.append(f"{value:.1f}%" if c == "hit" else f"{value * 1000:.1f} ms" if c == "per_tok"
                             else f"{value:.3f} s")
            out.append(f"| {workload} | fcfs (absolute) | " + " | ".join(cells) + " |")
            for family in families:
                if family == "fcfs":
                    continue
                pairs = [(results.get(f"{family}/{workload}/{load}/{s}"), baseline(results, family, workload, load, s))
                         for s in seeds]
                runs = [(r, b) for r, b in pairs if r is not None and b is not None]
                if not runs:
                    continue
                row = []
                for c in COLUMNS:
                    if c == "hit":
                        diffs = [r[c] - b[c] for r, b in runs]
                        row.append(f"{statistics.fmean(diffs):+.1f} pt [{min(diffs):+.1f}..{max(diffs):+.1f}]")
                    else:
                        ratios = [r[c] / b[c] for r, b in runs if b[c] > 0]
                        row.append(f"{statistics.fmean(ratios):.2f} [{min(ratios):.2f}..{max(ratios):.2f}]")
                label = f"{family} ({RUNS_AS[family]} again: the noise floor)" if family in RUNS_AS else family
                out.append(f"| {workload} | {label} | " + " | ".join(row) + " |")
    return "\n".join(out)


def capture_gain(results: dict[str, Any], families: list[str], seeds: list[int], workload: str,
                 load: float) -> str:
    """Each family's cut in mean e2e against FCFS, as a share of the oracle's, with its p99 ratio."""
    oracle = ratios(results, "oracle", workload, load, seeds, "mean")
    if not oracle:
        return ""
    oracle_gain = 1 - statistics.fmean(oracle)
    lines = [f"{workload} at {load:.0%}: oracle cuts mean e2e by {oracle_gain:.1%}"]
    for family in families:
        gains = ratios(results, family, workload, load, seeds, "mean")
        if family in ("fcfs", "oracle") or len(gains) != len(oracle):
            continue
        gain = 1 - statistics.fmean(gains)
        p99 = statistics.fmean(ratios(results, family, workload, load, seeds, "p99"))
        share = gain / oracle_gain if oracle_gain > 0 else float("nan")
        lines.append(f"  {family:14s} gain {gain:+.1%} ({share:.0%} of the oracle's), p99 x{p99:.2f}")
    return "\n".join(lines)


def ratios(results: dict[str, Any], family: str, workload: str, load: float, seeds: list[int],
           column: str) -> list[float]:
    """Per seed: ``family``'s ``column`` over the FCFS baseline's on the same trace, seed and load."""
    out = []
    for s in seeds:
        run, base = results.get(f"{family}/{workload}/{load}/{s}"), baseline(results, family, workload, load, s)
        if run and base and base[column] > 0:
            out.append(run[column] / base[column])
    return out


def noise(results: dict[str, Any], workload: str, load: float, seeds: list[int]) -> str:
    """FCFS-again's mean e2e ratio to FCFS, per seed: how far an unchanged order strays."""
    values = ratios(results, "fcfs-again", workload, load, seeds, "mean")
    return "/".join(f"{v:.2f}" for v in values) if values else "-"


def targets(results: dict[str, Any], families: list[str], seeds: list[int]) -> str:
    """The issue's targets, each with the figure measured (mean over seeds) and FCFS-again's for scale."""
    def mean(values: list[float]) -> float:
        return statistics.fmean(values) if values else float("nan")

    lines = ["Targets (mean over seeds; 'FCFS again' is the same FCFS run repeated: the noise floor):"]
    reordering = [f for f in families if f not in ("fcfs", "oracle", *RUNS_AS)]
    for workload in WORKLOADS:
        again = [mean(ratios(results, "fcfs-again", workload, 0.6, seeds, c)) for c in ("mean", "p99")]
        cells = []
        for family in reordering:
            m, p = (mean(ratios(results, family, workload, 0.6, seeds, c)) for c in ("mean", "p99"))
            if not math.isnan(m):
                cells.append(f"{family} x{m:.2f}/x{p:.2f}")
        if cells:
            lines.append(f"  60% load, {workload}: mean/p99 vs FCFS: {', '.join(cells)}; "
                         f"FCFS again x{again[0]:.2f}/x{again[1]:.2f}")
    oracle_gain = 1 - mean(ratios(results, "oracle", "conv", 0.9, seeds, "mean"))
    best = [(1 - mean(ratios(results, f, "conv", 0.9, seeds, "mean")), f) for f in reordering]
    best = [b for b in best if not math.isnan(b[0])]
    if best and not math.isnan(oracle_gain):
        gain, family = max(best)
        p99 = mean(ratios(results, family, "conv", 0.9, seeds, "p99"))
        share = gain / oracle_gain if oracle_gain > 0 else float("nan")
        lines.append(f"  90% load, conv: oracle cuts mean e2e by {oracle_gain:.1%}; best other: {family} "
                     f"{gain:+.1%} ({share:.0%} of the oracle's gain; target >= 50%), p99 x{p99:.2f} (target <= 1.2); "
                     f"FCFS again x{noise(results, 'conv', 0.9, seeds)}")
    best = [(1 - mean(ratios(results, f, "prefill", 0.9, seeds, "mean")), f) for f in reordering]
    best = [b for b in best if not math.isnan(b[0])]
    if best:
        gain, family = max(best)
        lines.append(f"  90% load, prefill: best {family} cuts mean e2e by {gain:.1%} (target >= 30%); "
                     f"ltr-promptlen {1 - mean(ratios(results, 'ltr-promptlen', 'prefill', 0.9, seeds, 'mean')):+.1%}; "
                     f"FCFS again x{noise(results, 'prefill', 0.9, seeds)}")
    for load in LOADS:
        pairs = [(results.get(f"affinity/templated/{load}/{s}"), baseline(results, "affinity", "templated", load, s))
                 for s in seeds]
        diffs = [r["hit"] - b["hit"] for r, b in pairs if r is not None and b is not None]
        if diffs:
            lines.append(f"  {load:.0%} load, templated: affinity raises the prefix-cache hit rate by "
                         f"{mean(diffs):+.1f} points [{min(diffs):+.1f}..{max(diffs):+.1f}] (target >= +5)")
    return "\n".join(lines)


def compact(results: dict[str, Any], families: list[str], seeds: list[int]) -> str:
    """One row per load and workload, one column per family: mean e2e / p99 as ratios to FCFS."""
    others = [f for f in families if f != "fcfs"]
    lines = ["| load | workload | " + " | ".join(f"`{f}`" for f in others) + " |",
             "|---|---|" + "---|" * len(others)]
    for load in LOADS:
        for workload in WORKLOADS:
            cells = []
            for family in others:
                m, p = (ratios(results, family, workload, load, seeds, c) for c in ("mean", "p99"))
                cells.append(f"{statistics.fmean(m):.2f} / {statistics.fmean(p):.2f}" if m and p else "-")
            if any(c != "-" for c in cells):
                lines.append(f"| {load:.0%} | {workload} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def report(results: dict[str, Any], families: list[str], seeds: list[int], workloads: list[str]) -> str:
    parts = [tables(results, families, seeds), ""]
    for workload in workloads:
        parts.append(capture_gain(results, families, seeds, workload, 0.9))
    parts += ["", targets(results, families, seeds), "", "Mean e2e / p99 as ratios to FCFS (mean over seeds):", "",
              compact(results, families, seeds)]
    return "\n".join(parts)


def ltr_check(out: Path, files: dict[tuple[str, int], Path], seeds: list[int]) -> str:
    """Offline ranker from the runtime's own full-level trace: fit on the templated replays of all
    seeds but the last, Kendall tau on the last (held out)."""
    from typer.testing import CliRunner

    from carbonforge_runtime.cli.main import app

    per_seed: dict[int, list[dict[str, Any]]] = {}
    with Session("fcfs", out, ENGINES["templated"], level="full", name="ltr-check") as session:
        for seed in seeds:
            per_seed[seed], _ = session.replay(files["templated", seed], "templated", rate=1e6, seed=seed)
    train, test = session.dir / "train-full.jsonl", session.dir / "held-out-full.jsonl"
    write_jsonl(train, [r for seed in seeds[:-1] for r in per_seed[seed]])
    write_jsonl(test, per_seed[seeds[-1]])
    model = session.dir / "ltr-model.json"
    tokenizer = str(tiny_model_dir())
    fitted = CliRunner().invoke(app, ["ltr", "fit", str(train), "-o", str(model), "--tokenizer", tokenizer,
                                      "--holdout", "0"])
    evaluated = CliRunner().invoke(app, ["ltr", "eval", str(model), str(test), "--tokenizer", tokenizer])
    return (f"ltr fit on the runtime's full trace ({train.name}): {fitted.output.strip()}\n"
            f"held-out seed {seeds[-1]}: {evaluated.output.strip()}")


# -- main --------------------------------------------------------------------------------------------


def main() -> int:
    global LOADS, WORKER_CPUS
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("/work/bench-out/ordering"))
    parser.add_argument("--families", default=",".join(FAMILY_ORDER))
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--loads", default=",".join(str(x) for x in LOADS),
                        help="loads as fractions of FCFS's capacity (default 0.6,0.9)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--first-seed", type=int, default=0, help="the seeds are FIRST .. FIRST + SEEDS - 1")
    parser.add_argument("--requests", type=int, default=150)
    parser.add_argument("--quick", action="store_true", help="one seed, fcfs and oracle only")
    parser.add_argument("--mode", choices=("switch", "sessions"), default="switch",
                        help="switch: one engine per workload, families take turns run by run (default); "
                        "sessions: one engine session per workload and family")
    parser.add_argument("--ltr-check-only", action="store_true",
                        help="only fit the ranker on the runtime's own full trace of the templated replays")
    parser.add_argument("--report-only", action="store_true", help="print the report of --out's results.json")
    parser.add_argument("--no-pin", action="store_true", help="do not pin the engine worker to a CPU of its own")
    args = parser.parse_args()
    LOADS = tuple(float(x) for x in args.loads.split(","))
    if not args.no_pin:
        WORKER_CPUS = pin_processes()
    families = args.families.split(",")
    workloads = [w for w in args.workloads.split(",") if w]
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    if args.quick:
        families, seeds = ["fcfs", "oracle"], [0]
    if families[0] != "fcfs":
        families = ["fcfs", *[f for f in families if f != "fcfs"]]
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / "results.json"
    results: dict[str, Any] = json.loads(results_path.read_text()) if results_path.exists() else {}
    if args.report_only:
        print(report(results, families, seeds, workloads))
        return 0

    files = make_workloads(out, seeds, args.requests, ltr_train=1500)
    # The ltr and hybrid families start from a model fitted offline on a full-level trace of the
    # templated workload (a different seed from the replayed ones), then keep learning online.
    model = out / "ltr-model.json"
    from typer.testing import CliRunner

    from carbonforge_runtime.cli.main import app

    fitted = CliRunner().invoke(app, ["ltr", "fit", str(files["train", 0]), "-o", str(model),
                                      "--tokenizer", str(tiny_model_dir()), "--holdout", "0.2"])
    print(fitted.output.strip())
    PARAMS["ltr"]["model"] = str(model)
    PARAMS["hybrid"]["model"] = str(model)

    if args.ltr_check_only:
        text = ltr_check(out, files, seeds)
        print(text)
        (out / "ltr-check.txt").write_text(text + "\n")
        return 0

    capacity: dict[str, float] = results.get("capacity_req_per_s", {})
    started = time.monotonic()

    def measure(session: Session, family: str, workload: str, load: float, seed: int) -> None:
        key = f"{family}/{workload}/{load}/{seed}"
        if key in results:
            return
        path = files[workload, seed]
        rate = load * capacity[f"{workload}/{seed}"] / recorded_rate(path)
        records, summary = session.replay(path, workload, rate, seed)
        results[key] = metrics(records)
        results[key]["failed"] = summary["failed"]
        m = results[key]
        print(f"  {key}: n={m['n']:.0f} mean {m['mean']:.3f} p99 {m['p99']:.3f} "
              f"wait {m['wait']:.3f} hit {m['hit']:.1f}% ({time.monotonic() - started:.0f} s)", flush=True)
        results_path.write_text(json.dumps(results, indent=1))

    def warm_up(session: Session, workload: str) -> None:
        """First shapes compile and caches fill (not measured)."""
        session.replay(files[workload, seeds[0]], workload, rate=1e6, seed=99, limit=60)

    def ensure_capacity(session: Session, workload: str, seed: int) -> None:
        """FCFS's capacity on this window (the session must be serving FCFS)."""
        if f"{workload}/{seed}" not in capacity:
            capacity[f"{workload}/{seed}"] = measure_capacity(session, files[workload, seed], workload, seed)
            results["capacity_req_per_s"] = capacity
            results_path.write_text(json.dumps(results, indent=1))

    for workload in workloads:
        engine = ENGINES[workload]
        if args.mode == "switch":
            # One engine per workload; the families take turns run by run (the order rotates), so
            # each comparison with FCFS is between runs a minute or two apart on the same engine.
            print(f"\n== {workload}: {engine} ({time.monotonic() - started:.0f} s)", flush=True)
            with Session(SWITCH, out, engine, name=f"session-{workload}") as session:
                session.activate("fcfs")
                warm_up(session, workload)
                turn = 0
                for seed in seeds:
                    session.activate("fcfs")
                    ensure_capacity(session, workload, seed)
                    for load in LOADS:
                        order = families[turn % len(families):] + families[: turn % len(families)]
                        turn += 1
                        for family in order:
                            session.activate(RUNS_AS.get(family, family))
                            measure(session, family, workload, load, seed)
        else:
            # The literal way: one engine session per family (session-to-session speed drift included).
            for family in families:
                print(f"\n== {workload}: {family} ({time.monotonic() - started:.0f} s)", flush=True)
                with Session(RUNS_AS.get(family, family), out, engine,
                             name=f"session-{workload}-{family}") as session:
                    warm_up(session, workload)
                    for seed in seeds:
                        if family == "fcfs":  # always the first session of a workload
                            ensure_capacity(session, workload, seed)
                        for load in LOADS:
                            measure(session, family, workload, load, seed)
    text = report(results, families, seeds, workloads)
    print(text)
    (out / "report.md").write_text(text + "\n")
    print(f"\ntotal {time.monotonic() - started:.0f} s; results in {results_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
